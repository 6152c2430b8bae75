"""common/ring_attention.py: a ring of 2 gloo ranks (torchrun, ring-flash-attn's llama3 varlen algorithm over
common.kernels.varlen_attention's kernels) against one process with transformers' sdpa on the same packed rows:
per-token log-probs, per-sample sums, loss and gradients on Llama and Qwen2 (4 query / 2 KV heads),
--ring_head_stride 1 and 2, with and without a pad token; a negative control without K/V exchange that
fails the same bars; one DeepSpeed ZeRO-2 / ZeRO-3 SGD step against one process; the chunked LM head through the
ring and under ZeRO-3 against whole logits; sft.py, dpo.py and the
trainer groups of grpo.py and ppo.py with a ring against one process; and the argument and model checks."""

import json
import os
import subprocess
import sys

import pytest
import torch

from common.infra.rings import RingArgs, ring_model_args, validate_ring_args
from common.ring_attention import NAME, check_ring_model, import_ring_flash_attn
from conftest import ROOT

LAYERS, KV_HEADS = 2, 2
BARS = {"logps": 1e-5, "sample_sums": 1e-4, "loss_rel": 1e-5, "grads_rel": 1e-5}


def tiny_config(arch, **extra):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=32, max_position_embeddings=256,
               **{"tie_word_embeddings": False, **extra})


@pytest.fixture(scope="module")
def gqa_models(tmp_path_factory):
    """Random-init tiny Llama and Qwen2 with grouped queries (4 query heads over 2 KV heads), and a Qwen2 with
    tied embeddings."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ring_models")
    configs = {"llama": tiny_config("llama"), "qwen2": tiny_config("qwen2"),
               "qwen2-tied": tiny_config("qwen2", tie_word_embeddings=True)}
    for name, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out / name)
    return {name: str(out / name) for name in configs}


def run_check(mode, out, paths):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.scripts.ring_check", mode, str(out), *paths]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ring_results(gqa_models, assets, tmp_path_factory):
    """One torchrun of tests/scripts/ring_check.py for the model checks, the DeepSpeed steps and the chunked LM
    head under ZeRO-3 (on llama-0.5m and the tied Qwen2; the qwen2-0.5m asset's embeddings are not tied)."""
    result = run_check("all", tmp_path_factory.mktemp("ring") / "all.json",
                       [gqa_models["llama"], gqa_models["qwen2"], "--zero3_head", f"{assets}/llama-0.5m",
                        gqa_models["qwen2-tied"]])
    print(json.dumps(result, indent=1))
    return result


def test_ring_of_two_equals_full_attention(ring_results):
    result = dict(ring_results)
    assert result.pop("flash_attn_imported") is False  # the CPU kernels were shown to ring-flash-attn only
    for arch in ("llama", "qwen2"):
        for stride in (1, 2):
            for total in (24, 25):  # 25 tokens: the row gets one pad token to split evenly
                got = result[f"{arch}/stride{stride}/T{total}"]
                for key, bar in BARS.items():
                    assert got[key] <= bar, (arch, stride, total, key, got[key])
                assert got["same_on_ring"] == 0.0  # both ranks of the ring hold the same row of log-probs
                assert got["kernel_calls"] == LAYERS * KV_HEADS // stride  # one call per group of KV heads
        control = result[f"{arch}/no_kv_exchange"]  # each rank attends only within its own slice
        assert control["kernel_calls"] == 0
        assert control["logps"] > 1e-2 and control["grads_rel"] > 1e-2 and control["loss_rel"] > 1e-4, control


def test_chunked_head_through_the_ring_equals_whole_logits_and_one_process(ring_results):
    """ring_token_logps with the chunked LM head (chunks of 5 over each rank's 13-token slice) = the ring with
    whole logits = one process: log-probs, entropy, argmax hits and every gradient (the head's included)."""
    for arch in ("llama", "qwen2"):
        got = ring_results[f"{arch}/chunked_head"]
        for key in ("logps_vs_whole", "logps_vs_one", "entropy_vs_whole", "entropy_vs_one", "grads_vs_whole",
                    "grads_vs_one"):
            assert got[key] <= 1e-5, (arch, key, got[key])
        assert got["hits_equal"] and got["hits"] >= 3, got  # the row has argmax hits to compare
        assert got["head_grad"] > 1e-2 and got["no_logits_made"], got
        assert got["slice_logits"] <= 1e-5, got  # outputs.logits, computed on read, are the slice's


def test_chunked_head_under_zero3_equals_whole_logits(ring_results):
    """token_logps under DeepSpeed ZeRO-3 over 2 ranks (the head weight partitioned, each rank on a row of its own
    length, so 3 and 5 chunks of 16): chunked = whole logits in log-probs, entropy, argmax hits and every full
    gradient, for Llama and for Qwen2 with tied embeddings (the head's gradient is the embedding's)."""
    for name, tied in (("llama-0.5m", False), ("qwen2-tied", True)):
        got = ring_results[f"zero3_head/{name}"]
        assert got["logps"] <= 1e-5 and got["entropy"] <= 1e-5 and got["grads"] <= 1e-5, (name, got)
        assert got["hits_differ"] == 0 and got["hits"] >= 3 and got["same_grad_names"], (name, got)
        assert got["tied"] is tied and got["head_grad"] > 1e-2, (name, got)


def test_plain_student_head_agrees_chunks_with_an_offloaded_zero3_teacher(ring_results):
    """distill.py's token_losses beside --teacher_offload (the teacher's head ZeRO-3, the student's a plain module),
    ranks with 5 and 13 loss tokens: the run ends (the ranks gather the teacher's head as often) and the chunked
    KD, CE and student gradients equal whole logits'."""
    got = ring_results["zero3_teacher"]
    assert got["kd"] <= 1e-5 and got["ce"] <= 1e-5 and got["grads"] <= 1e-5 and got["kd_min"] > 1e-4, got



def test_one_deepspeed_step_with_a_ring_equals_one_process(ring_results):
    """SGD, lr 1, no clipping (Adam's first step is about sign(grad) and amplifies noise on tiny gradients)."""
    for stage in (2, 3):
        got = ring_results[f"zero{stage}"]
        assert got["param_diff"] <= 1e-6 and got["largest_change"] > 0.1, got
        assert got["ds_train_batch_size"] == 2 and got["gas"] == 1  # DeepSpeed counts both ring ranks


@pytest.mark.quick
def test_ring_flash_attn_imports_over_the_cpu_kernels_only_while_it_imports():
    from transformers.utils import is_flash_attn_2_available

    ring_fn, prepare = import_ring_flash_attn()
    assert ring_fn.__module__ == "ring_flash_attn.llama3_flash_attn_varlen"
    assert "flash_attn" not in sys.modules and not is_flash_attn_2_available()
    # the llama3 split of a packed row [0, 5, 15, 22, 24] over two ranks (rank 1's queries reach back to 5)
    cu = torch.tensor([0, 5, 15, 22, 24], dtype=torch.int32)
    cu_q, cu_k, _, _, k_slice = prepare(cu, True, 1, 2)
    assert cu_q.tolist() == [0, 3, 10, 12] and cu_k.tolist() == [0, 10, 17, 19] and k_slice == slice(5, 24)


@pytest.mark.quick
def test_bad_ring_arguments_fail_naming_the_flag():
    from types import SimpleNamespace

    from common.infra.engine import ModelArgs

    data = SimpleNamespace(packing_samples=True, pack_max_tokens=0)  # the two fields read from DataArgs
    with pytest.raises(ValueError, match="--ring_attn_size 3 must divide the world size 4"):
        validate_ring_args(RingArgs(ring_attn_size=3), 4)
    with pytest.raises(ValueError, match="--ring_head_stride"):
        validate_ring_args(RingArgs(ring_head_stride=0), 2)
    with pytest.raises(ValueError, match="--no_packing_samples"):
        validate_ring_args(RingArgs(ring_attn_size=2), 2, data=SimpleNamespace(packing_samples=False))
    with pytest.raises(ValueError, match="--pack_max_tokens does not apply"):
        validate_ring_args(RingArgs(ring_attn_size=2), 2, data=SimpleNamespace(packing_samples=True,
                                                                                 pack_max_tokens=64))
    with pytest.raises(ValueError, match="--attn_implementation sdpa cannot run with --ring_attn_size"):
        validate_ring_args(RingArgs(ring_attn_size=2), 2, ModelArgs(pretrain="m", attn_implementation="sdpa"), data)
    with pytest.raises(ValueError, match="--aux_loss_coef"):
        validate_ring_args(RingArgs(ring_attn_size=2), 2, ModelArgs(pretrain="m", aux_loss_coef=0.01), data)
    model = ModelArgs(pretrain="m")
    assert validate_ring_args(RingArgs(ring_attn_size=2), 4, model, data) == 2  # the data-parallel size
    assert model.attn_implementation is None  # validation changes nothing; ring_model_args resolves
    assert ring_model_args(model, RingArgs(ring_attn_size=2)).attn_implementation == NAME
    assert ring_model_args(model, RingArgs()) is model
    assert validate_ring_args(RingArgs(), 4, ModelArgs(pretrain="m"), data) == 4


@pytest.mark.quick
def test_models_the_ring_cannot_run_fail_before_training():
    from transformers import AutoModelForCausalLM, BloomConfig

    from common.ring_attention import Ring

    ring = Ring(size=2, rank=0, group=None, head_stride=1, dp_rank=0, dp_world=1)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=NAME)
    check_ring_model(model, ring)
    with pytest.raises(ValueError, match="--ring_head_stride 3 must divide the model's 2 KV heads"):
        check_ring_model(model, Ring(size=2, rank=0, group=None, head_stride=3, dp_rank=0, dp_world=1))
    windowed = AutoModelForCausalLM.from_config(
        tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0), attn_implementation=NAME)
    with pytest.raises(ValueError, match="--ring_attn_size: qwen2 uses sliding-window"):
        check_ring_model(windowed, ring)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=256, hidden_size=64, n_layer=1, n_head=2),
                                             attn_implementation=NAME)
    with pytest.raises(ValueError, match="--ring_attn_size: bloom models do not route their attention"):
        check_ring_model(bloom, ring)
    plain = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="--ring_attn_size needs the model loaded with attn_implementation"):
        check_ring_model(plain, ring)


def curves(path):
    from conftest import read_jsonl

    return read_jsonl(path)


@pytest.mark.parametrize("script", ["sft", "dpo", "distill"])
def test_script_with_a_ring_of_two_equals_data_parallel(assets, tmp_path, script):
    """`--ring_attn_size 2` on 2 ranks (one data-parallel replica, each packed row split over the ring) gives the
    loss curve, log-probs and gradient norms of one process with the same global batch and micro-batches."""
    from conftest import max_weight_diff, run_scripts

    data = f"{assets}/data/reverse"
    common = ["--pretrain", f"{assets}/llama-0.5m", "--apply_chat_template", "--max_len", 64, "--max_samples", 32,
              "--train_batch_size", 16, "--micro_train_batch_size", 4,
              "--param_dtype", "fp32"]  # equivalence in fp32: bf16 matmuls round differently per split
    if script == "sft":  # ZeRO-2
        common += ["--dataset", f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key", "response",
                   "--learning_rate", 3e-3, "--zero_stage", 2]
        keys = ("train/loss", "train/grad_norm")
    elif script == "distill":  # ZeRO-2, a live teacher, the student's head in chunks of 8 loss tokens
        common += ["--dataset", f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key", "response",
                   "--teacher_model", f"{assets}/qwen2-0.5m", "--learning_rate", 3e-3, "--kd_coef", 0.5,
                   "--logps_chunk_tokens", 8, "--zero_stage", 2]
        keys = ("train/loss", "train/kd", "train/nll", "train/grad_norm")
    else:  # ZeRO-3, the reference cached by plain data-parallel forwards, an NLL term
        common += ["--dataset", f"{data}/pref_train.jsonl", "--learning_rate", 3e-4, "--beta", 0.1,
                   "--nll_loss_coef", 0.5, "--zero_stage", 3]
        keys = ("train/loss", "train/grad_norm", "train/logps/chosen", "train/logps/rejected", "train/nll_loss")
    configs = (("ring", 2, ["--ring_attn_size", 2]), ("one", 1, []))
    run_scripts([(f"{script}.py", [*common, *extra, "--save_path", tmp_path / name, "--metrics_file",
                                   tmp_path / f"{name}.jsonl"], {"nproc": nproc}) for name, nproc, extra in configs])
    runs = {name: curves(tmp_path / f"{name}.jsonl") for name, *_ in configs}
    assert len(runs["ring"]) == len(runs["one"]) == 2
    worst = {k: max(abs(r[k] - d[k]) / max(abs(d[k]), 1.0) for r, d in zip(runs["ring"], runs["one"])) for k in keys}
    print(f"\n{script} ring vs one process, max |diff| / max(1, |value|):", worst)
    assert all(v <= 1e-5 for v in worst.values()), worst
    assert max_weight_diff(tmp_path / "ring", f"{assets}/llama-0.5m") > 1e-4  # the steps did train


RL_KEYS = {"grpo": ("train/policy_loss", "train/kl_loss", "train/entropy", "train/grad_norm"),
           "ppo": ("train/policy_loss", "train/entropy", "train/grad_norm", "train/clip_ratio", "critic/value_loss",
                   "critic/grad_norm", "critic/values", "critic/explained_variance")}


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_rl_trainers_with_a_ring_of_two_equal_one_rank(assets, rl_start_model, tmp_path, script):
    """The Ray drivers' trainer groups under `--ring_attn_size 2` (2 ranks, one data-parallel replica; grpo.py:
    the policy and its reference; ppo.py: actor and critic each a ring of 2) against one rank each, one rollout
    step on the same samples (vLLM samples the same tokens from the same weights and seeds): the losses, KL,
    entropy, values and gradient norms the trainers log, and vLLM's log-probs against the ring's."""
    from conftest import max_weight_diff, read_jsonl, run_scripts

    common = ["--pretrain", rl_start_model, "--prompt_data", f"{assets}/data/reverse/rl_train.jsonl",
              "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template",
              "--remote_rm_url", os.path.join(ROOT, "launch", "rewards", "exact_match.py"),
              "--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--micro_train_batch_size", 8,
              "--micro_rollout_batch_size", 8, "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len",
              128, "--max_steps", 1, "--actor_learning_rate", 1e-3, "--entropy_loss_coef", 0.01,
              "--param_dtype", "fp32", "--vllm_num_engines", 1]  # fp32: bf16 matmuls round differently per split
    if script == "grpo":  # the KL in the loss: the reference runs in the trainer's ring
        common += ["--train_batch_size", 16, "--init_kl_coef", 0.05, "--use_kl_loss", "--kl_estimator", "k3"]
        ranks = lambda n: ["--actor_num_gpus_per_node", n]  # noqa: E731
    else:  # two optimizer steps: the actor's log-probs before the update (a ring), the critic (a ring of its own)
        common += ["--train_batch_size", 8, "--critic_learning_rate", 1e-3]
        ranks = lambda n: ["--actor_num_gpus_per_node", n, "--critic_num_gpus_per_node", n]  # noqa: E731
    configs = {"ring": [*ranks(2), "--ring_attn_size", 2], "one": ranks(1)}
    run_scripts([(f"{script}.py", [*common, *extra, "--save_path", tmp_path / name, "--metrics_file",
                                   tmp_path / f"{name}.jsonl"], {"timeout": 900}) for name, extra in configs.items()])
    runs = {}
    for name in configs:
        (runs[name],) = [m for m in read_jsonl(tmp_path / f"{name}.jsonl") if "train/reward" in m]
    ring, one = runs["ring"], runs["one"]
    assert ring["train/reward"] == one["train/reward"] and ring["train/response_length"] == one["train/response_length"]
    worst = {k: abs(ring[k] - one[k]) / max(abs(one[k]), 1.0) for k in RL_KEYS[script]}
    print(f"\n{script} ring vs one rank, |diff| / max(1, |value|):", worst)
    assert all(v <= 1e-5 for v in worst.values()), worst
    assert ring["rollout/logp_abs_diff_max"] <= 1e-4  # the ring's log-probs of the samples are vLLM's
    assert ring["train/reward_std"] > 0  # the advantages carry a signal
    # (the weights after the step are not compared: Adam's first step turns rounding noise on near-zero gradients
    # into lr-sized differences, 6e-5 at lr 1e-3 in one grpo run; the gradient norms above are the check)
    assert max_weight_diff(tmp_path / "ring", rl_start_model) > 1e-4  # the step did train


def test_a_ring_that_does_not_divide_the_world_fails_before_loading(assets):
    from conftest import run_script

    proc = run_script("sft.py", ["--pretrain", f"{assets}/llama-0.5m", "--dataset", "unused.jsonl",
                                 "--ring_attn_size", 2], expect_ok=False)
    assert proc.returncode != 0
    assert "error: --ring_attn_size 2 must divide the world size 1" in proc.stderr, proc.stderr[-2000:]


def _kernel_results(forward, backward, tensors, cu_q, cu_k, max_q, max_k, device):
    """out, lse, dq, dk, dv of a flash-attn-contract varlen kernel pair, its arguments filled by name the way
    ring-flash-attn fills them (ring_flash_attn.utils.get_default_args)."""
    from ring_flash_attn.utils import get_default_args

    q, k, v, dout = (t.to(device) for t in tensors)
    common = {"cu_seqlens_q": cu_q.to(device), "cu_seqlens_k": cu_k.to(device), "max_seqlen_q": max_q,
              "max_seqlen_k": max_k, "dropout_p": 0.0, "softmax_scale": q.shape[-1] ** -0.5, "causal": True,
              "alibi_slopes": None}
    params = {**get_default_args(forward), **common, "q": q, "k": k, "v": v, "return_softmax": False}
    window = {"window_size": (-1, -1)} if "window_size" in params else {"window_size_left": -1, "window_size_right": -1}
    out, lse = forward(**{**params, **window})[:2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    params = {**get_default_args(backward), **common, "dout": dout, "q": q, "k": k, "v": v, "out": out,
              "softmax_lse": lse, "dq": dq, "dk": dk, "dv": dv, "deterministic": False}
    backward(**{**params, **window})
    return [t.float().cpu() for t in (out, lse, dq, dk, dv)]


def _ring_split_tensors(rank, size=2, heads=8, kv_heads=2, dim=64, dtype=torch.bfloat16):
    """This rank's llama3 split of a packed row of 256 tokens (4 samples, two crossing the split): local queries,
    the keys / values they need, a gradient for the output, and the local cu_seqlens."""
    _, prepare = import_ring_flash_attn()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(256, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(256 // size, heads, dim, generator=g).to(dtype)
    cu_q, cu_k, max_q, max_k, k_slice = prepare(torch.tensor([0, 37, 100, 161, 256], dtype=torch.int32), True,
                                                rank, size)
    local = slice(rank * 256 // size, (rank + 1) * 256 // size)
    return (q[local], k[k_slice], v[k_slice], dout), cu_q, cu_k, max_q, max_k


@pytest.mark.quick
def test_cpu_kernels_in_flash_attn_contract_run_bf16_on_the_ring_splits():
    """The CPU half of the GPU check below, on CPU: the stand-ins, called the way ring-flash-attn calls flash-attn,
    give in bf16 what they give in fp32 on both ranks' splits, to bf16 tolerance."""
    from common.ring_attention import _cpu_varlen_backward, _cpu_varlen_forward

    for rank in (0, 1):
        tensors, *cu = _ring_split_tensors(rank)
        bf16 = _kernel_results(_cpu_varlen_forward, _cpu_varlen_backward, tensors, *cu, "cpu")
        fp32 = _kernel_results(_cpu_varlen_forward, _cpu_varlen_backward, [t.float() for t in tensors], *cu, "cpu")
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), bf16, fp32):
            assert b.abs().max() > 0 and (a - b).abs().max().item() <= 2e-2 * max(1.0, b.abs().max().item()), name


@pytest.mark.quick
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn's varlen kernels need CUDA")
def test_cpu_kernels_match_flash_attn_on_the_ring_splits():
    """The CPU stand-in (common.kernels.varlen_attention's kernels in flash-attn's contract) against flash-attn's own
    `_flash_attn_varlen_forward/_backward` on the llama3 splits of both ranks, bf16, GQA 8 / 2 heads: out, lse,
    dq, dk, dv within bf16 tolerance (2e-2 of each tensor's largest value)."""
    fa = pytest.importorskip("flash_attn.flash_attn_interface")
    from common.ring_attention import _cpu_varlen_backward, _cpu_varlen_forward

    for rank in (0, 1):
        tensors, *cu = _ring_split_tensors(rank)
        cpu = _kernel_results(_cpu_varlen_forward, _cpu_varlen_backward, tensors, *cu, "cpu")
        cuda = _kernel_results(fa._flash_attn_varlen_forward, fa._flash_attn_varlen_backward, tensors, *cu, "cuda")
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), cpu, cuda):
            assert (a - b).abs().max().item() <= 2e-2 * max(1.0, b.abs().max().item()), (rank, name)

