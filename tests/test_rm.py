"""algos/rm.py through its real CLI (pairwise RM under ZeRO-2 / ZeRO-3, PRM), its losses against
hand-computed values, packed = padded rewards, the Hugging Face export, common/infra/reward.py scoring
(plain model and ZeRO-3 eval engine), bad input and argument errors.

Run as a script (`torchrun ... tests/test_rm.py MODEL OUT`) this file is the ZeRO-3 scoring worker."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import PYTHONPATH, ROOT, load_algo, read_jsonl, run_script

from common.data import BadRow, DataArgs, reward_model_ids

from common.infra.datasets import prepare_dataset
from common.packing import Layout, collate
from common.infra.reward import reward_index, score, sequence_rewards

PAIR = ["--prompt_key", "prompt", "--apply_chat_template", "--max_len", "64"]
PRM = ["--prm", "--prompt_key", "prompt", "--input_key", "response", "--placeholder_token", ";",
       "--apply_chat_template",
       "--max_len", "64"]


def pair_args(*extra):
    return load_algo("rm").parse_args(["--pretrain", "m", "--dataset", "d.jsonl", *PAIR, *extra])


def prm_args(*extra):
    return load_algo("rm").parse_args(["--pretrain", "m", "--dataset", "d.jsonl", *PRM, *extra])


def usable_pairs(path, tokenizer, args):
    """rm.py's pair_row over a file, skipping the rows it rejects (as --skip_bad_rows does)."""
    out = []
    for row in read_jsonl(path):
        try:
            out.append(load_algo("rm").pair_row(row, tokenizer, args))
        except BadRow:
            pass
    return out


def samples(seqs):
    return [{"input_ids": s, "loss_mask": [0] * len(s)} for s in seqs]


@torch.no_grad()
def hf_rewards(model, seqs, pad_id, batch_size=64):
    """Rewards from the model's own forward (Hugging Face pooling), right-padded batches."""
    out = []
    for k in range(0, len(seqs), batch_size):
        chunk = seqs[k : k + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in chunk])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
        out.append(model(input_ids=ids, attention_mask=mask).logits[:, 0])
    return torch.cat(out)


@pytest.fixture(scope="module")
def rm_start(sft_model, tmp_path_factory):
    """The SFT model as AutoModelForSequenceClassification with a seeded value head, saved: a reward
    model whose rewards a test can compute in-process before rm.py trains it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = str(tmp_path_factory.mktemp("rm_start"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(sft_model, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # rewards of order 1, so the loss terms differ visibly
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(sft_model).save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------
# Losses against hand-computed values
# ----------------------------------------------------------------------------------------------
@pytest.mark.quick
def test_pairwise_loss_hand_computed():
    rm = load_algo("rm")
    chosen, rejected = torch.tensor([1.0, 0.0, -0.5]), torch.tensor([0.0, 0.0, 0.5])
    # -log sigmoid(d) = log(1 + exp(-d)); d = 1, 0, -1
    expected = [math.log(1 + math.exp(-1)), math.log(2), math.log(1 + math.exp(1))]
    assert torch.allclose(rm.pairwise_loss(chosen, rejected), torch.tensor(expected), atol=1e-6)
    assert abs(expected[0] - 0.3132617) < 1e-7 and abs(expected[2] - 1.3132617) < 1e-7
    # margins 0.5, 0, 1: d = 0.5, 0, -2
    margin = torch.tensor([0.5, 0.0, 1.0])
    expected = [math.log(1 + math.exp(-0.5)), math.log(2), math.log(1 + math.exp(2))]
    assert torch.allclose(rm.pairwise_loss(chosen, rejected, margin), torch.tensor(expected), atol=1e-6)
    assert abs(expected[0] - 0.4740770) < 1e-7 and abs(expected[2] - 2.1269280) < 1e-7


@pytest.mark.quick
def test_prm_loss_hand_computed():
    rm = load_algo("rm")
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 2.0]])
    targets = torch.tensor([1.0, 0.0, 0.8, 0.25])  # hard good, hard bad, soft, soft
    # log softmax: [2, 0] -> (-0.126928, -2.126928); [0, 1] -> (-1.313262, -0.313262); [1, 1] -> (-0.693147,) x 2
    expected = torch.tensor([0.1269280, 0.3132617, 0.6931472, 0.25 * 2.1269280 + 0.75 * 0.1269280])
    assert torch.allclose(rm.prm_loss(logits, targets), expected, atol=1e-6)


@pytest.mark.quick
def test_prm_loss_only_at_step_tags(assets):
    """forward_loss on a packed batch of soft-labelled rows (read through datasets as rm.py does)
    equals the cross-entropy computed by hand from each row's own unpacked forward at its tags."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rm = load_algo("rm")
    args = prm_args()
    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    tag, good, bad = (tokenizer.convert_tokens_to_ids(t) for t in (";", "+", "-"))
    ds = prepare_dataset(f"{assets}/data/count/prm_soft_test.jsonl", "train",
                         lambda r: rm.step_row(r, tokenizer, args, tag, ("+", "-")), ("input_ids", "step_labels"),
                         args.data, ["test_prm_loss_only_at_step_tags"], max_samples=6)
    raw = read_jsonl(f"{assets}/data/count/prm_soft_test.jsonl")[:6]
    model = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", attn_implementation="sdpa").eval()
    (chunk,) = rm.micro_batches_of(ds, range(6), 6, args)
    with torch.no_grad():
        batch = rm.make_batch(chunk, args, tokenizer.pad_token_id, Layout(one_row=False, share_prefixes=False))
        loss_sum, stats = rm.forward_loss(model, batch, args, [good, bad])
        expected, steps = 0.0, 0
        for row, sample in zip(raw, chunk):
            logits = model(input_ids=torch.tensor([sample["input_ids"]])).logits[0]
            tags = [i for i, t in enumerate(sample["input_ids"]) if t == tag]
            assert len(tags) == len(row["labels"]) >= 2
            for i, p in zip(tags, row["labels"]):  # the soft labels straight from the file
                logp = torch.log_softmax(logits[i, [good, bad]], -1)
                expected -= p * logp[0].item() + (1 - p) * logp[1].item()
                steps += 1
    assert stats["units"] == steps
    assert abs(loss_sum.item() - expected) <= 1e-4, (loss_sum.item(), expected)


# ----------------------------------------------------------------------------------------------
# Rewards: packed = padded = Hugging Face's own forward; the pooling rule
# ----------------------------------------------------------------------------------------------
def test_packed_rewards_equal_padded_and_hf(assets, rm_start):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_start)
    pairs = usable_pairs(f"{assets}/data/reverse/pref_test.jsonl", tokenizer, pair_args())[:16]
    seqs = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
    assert len({len(s) for s in seqs}) > 3
    model = AutoModelForSequenceClassification.from_pretrained(rm_start, attn_implementation="sdpa").eval()
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        packed_batch = collate(samples(seqs), pad, packing=True, max_tokens=64)
        assert packed_batch["input_ids"].shape[0] < len(seqs) // 2  # several samples per row
        packed = sequence_rewards(model, packed_batch)
        padded = sequence_rewards(model, collate(samples(seqs), pad, packing=False))
    hf = hf_rewards(model, seqs, pad)
    assert (packed - padded).abs().max().item() <= 1e-4
    assert (packed - hf).abs().max().item() <= 1e-4
    assert packed.std().item() > 0.1  # the rewards differ, so the comparison means something
    # rm.py's layout with the CPU kernel: each rejected sequence a branch of its chosen one's shared prompt
    import datasets

    from common.kernels.varlen_attention import NAME

    varlen = AutoModelForSequenceClassification.from_pretrained(rm_start, attn_implementation=NAME).eval()
    (pair_samples,) = load_algo("rm").micro_batches_of(datasets.Dataset.from_list(pairs), range(16), 16, pair_args())
    with torch.no_grad():
        shared_batch = collate(pair_samples, pad, one_row=True, share_prefixes=True)
        shared = sequence_rewards(varlen, shared_batch)
    assert shared_batch["input_ids"].numel() < 0.8 * sum(len(s) for s in seqs)  # the prompts appear once
    assert (shared - hf).abs().max().item() <= 1e-4
    # score(): texts or token ids, one model or several with weights
    texts = [tokenizer.decode(s) for s in seqs[:5]]
    assert (score(model, texts, tokenizer, batch_size=2) - hf[:5]).abs().max().item() <= 1e-4
    assert (score([model, model], seqs[:5], weights=[1.0, 0.5]) - 1.5 * hf[:5]).abs().max().item() <= 1e-4


@pytest.mark.quick
def test_reward_index_is_each_samples_own_last_token():
    """The reward is read at each sample's own last token, whatever the pad id: with a tokenizer whose pad token is
    its EOS (id 1 here), a finished response (ending in EOS) and a truncated one (no EOS) are read at different
    tokens, the EOS and the last word, so a reward model can penalise truncation. Packed and padded alike."""
    seqs = [[5, 6, 7, 1], [5, 6, 7], [9]]  # finished, truncated, one token
    for batch in (collate(samples(seqs), 1, packing=True, max_tokens=8), collate(samples(seqs), 1, packing=False)):
        flat = batch["input_ids"].flatten()
        assert flat[reward_index(batch)].tolist() == [1, 7, 9]


# ----------------------------------------------------------------------------------------------
# Pairwise reward model: learns under ZeRO-2 and ZeRO-3; the export is a plain HF reward model
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_pairwise_rm_learns_and_exports(assets, sft_model, tmp_path, zero_stage):
    """3 epochs of the reversal preference pairs (186 steps of 32, lr 5e-4, --seed 42, one thread per rank):
    the first-step loss is that of an untrained head (> 0.6; log 2 = 0.693), the held-out accuracy ends at
    >= 0.85 and the mean held-out margin r_chosen - r_rejected above 2.

    Measured (2-core AMD EPYC with AVX512-BF16; 22 runs): --seed 42 and 1-7 at ZeRO-2 and ZeRO-3 from the
    test's SFT model, and --seed 42, 1, 2 at ZeRO-2 from SFT models trained with --seed 1 and 2 (a start point
    perturbed as another CPU's float results would perturb it); OMP_NUM_THREADS 1, and 2 for two of them
    (identical to every digit, as were ZeRO-2 and ZeRO-3 to 1e-3): accuracy 0.914-0.985 (this test's run: 0.924),
    margin 3.69-6.17, first-step loss 0.677-0.705. The bars sit below those minima: 0.85 is 13 of the 198
    held-out pairs below the lowest accuracy. At lr 2e-3 the same grid (28 runs) spread 0.71-0.975, margin
    0.91-10.1: too high a rate for this 0.5M model, whose outcome then hangs on float noise (this test's run at
    ZeRO-2 / ZeRO-3 differed by up to 0.09 between machines). ~15-30 s per run on 2 cores."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    data = f"{assets}/data/reverse"
    out, metrics_file = tmp_path / "rm", tmp_path / "metrics.jsonl"
    proc = run_script("rm.py", [
        "--pretrain", sft_model, "--dataset", f"{data}/pref_train.jsonl", "--eval_dataset", f"{data}/pref_test.jsonl",
        *PAIR, "--train_batch_size", 32, "--micro_train_batch_size", 16, "--max_epochs", 3, "--learning_rate", 5e-4,
        "--seed", 42, "--zero_stage", zero_stage, "--skip_bad_rows", "--save_path", out, "--metrics_file", metrics_file,
    ], nproc=2)
    # the reverse data has palindromes, whose wrong answer (a rotation) equals the right one: counted skips
    assert ("pref_train.jsonl: skipped 5 bad row(s) of 2000; first: row 66: fields 'chosen' and 'rejected' are "
            "identical") in proc.stdout
    metrics = read_jsonl(metrics_file)
    assert len([m for m in metrics if "train/loss" in m]) == 3 * (1995 // 32)
    final = metrics[-1]
    assert metrics[0]["train/loss"] > 0.6 and final["eval/accuracy"] >= 0.85, (metrics[0], final)
    assert final["eval/margin"] > 2.0, final

    # the export: AutoModelForSequenceClassification, the trainer's rewards, mean / std in the config
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    assert config.mean == final["eval/reward_mean"] and config.std == final["eval/reward_std"]
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    pairs = usable_pairs(f"{data}/pref_test.jsonl", tokenizer, pair_args())
    chosen = hf_rewards(model, [p["chosen_ids"] for p in pairs], tokenizer.pad_token_id)
    rejected = hf_rewards(model, [p["rejected_ids"] for p in pairs], tokenizer.pad_token_id)
    everything = torch.cat([chosen, rejected])
    assert abs(everything.mean().item() - config.mean) <= 1e-4 and abs(everything.std().item() - config.std) <= 1e-4
    assert abs((chosen > rejected).float().mean().item() - final["eval/accuracy"]) <= 1e-6
    assert abs(chosen.mean().item() - final["eval/chosen_reward"]) <= 1e-4
    assert abs(rejected.mean().item() - final["eval/rejected_reward"]) <= 1e-4
    assert abs((chosen - rejected).mean().item() - final["eval/margin"]) <= 1e-4
    # common.infra.reward.score (packed) gives the same per-sample rewards, and normalises with the stored statistics
    seqs = [p["chosen_ids"] for p in pairs[:20]]
    assert (score(model, seqs, batch_size=8) - chosen[:20]).abs().max().item() <= 1e-4
    expected = (chosen[:20] - config.mean) / config.std
    assert (score(model, seqs, normalize=True) - expected).abs().max().item() <= 1e-4


def test_margin_loss_and_normalisation_one_step(assets, rm_start, tmp_path):
    """One optimizer step over 16 pairs with per-row margins, 2 ranks x micro 4 x 2 accumulation
    steps: the logged loss is the mean of -log sigmoid(r_c - r_r - margin) over the 16 pairs."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = read_jsonl(f"{assets}/data/reverse/pref_train.jsonl")[:16]
    for i, row in enumerate(rows):
        row["margin"] = 0.5 * (i % 4)
    data = tmp_path / "margin.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script("rm.py", [
        "--pretrain", rm_start, "--dataset", data, *PAIR, "--margin_loss", "--train_batch_size", 16,
        "--micro_train_batch_size", 4, "--learning_rate", 1e-4, "--max_norm", 0, "--save_path", tmp_path / "out",
        "--metrics_file", tmp_path / "m.jsonl",
    ], nproc=2)
    (logged,) = read_jsonl(tmp_path / "m.jsonl")

    tokenizer = AutoTokenizer.from_pretrained(rm_start)
    model = AutoModelForSequenceClassification.from_pretrained(rm_start).eval()
    pairs = [load_algo("rm").pair_row(r, tokenizer, pair_args("--margin_loss")) for r in rows]
    chosen = hf_rewards(model, [p["chosen_ids"] for p in pairs], tokenizer.pad_token_id)
    rejected = hf_rewards(model, [p["rejected_ids"] for p in pairs], tokenizer.pad_token_id)
    margin = torch.tensor([p["margin"] for p in pairs])
    with_margin = torch.nn.functional.softplus(-(chosen - rejected - margin)).mean().item()
    without = torch.nn.functional.softplus(-(chosen - rejected)).mean().item()
    assert abs(logged["train/loss"] - with_margin) <= 1e-5, (logged["train/loss"], with_margin)
    assert abs(with_margin - without) > 0.1  # the margins changed the loss
    assert abs(logged["train/accuracy"] - (chosen > rejected).float().mean().item()) <= 1e-6


# ----------------------------------------------------------------------------------------------
# Process reward model: step accuracy rises; the export is a plain causal LM read at the tags
# ----------------------------------------------------------------------------------------------
def test_prm_learns_and_exports(assets, tmp_path):
    """The untrained 0.5M model as a PRM, 3 epochs (279 steps of 32, lr 1e-3, --seed 42, one thread per rank),
    evaluated every 31 steps: held-out step accuracy near the majority label (0.537 of the held-out steps) after
    31 steps (< 0.7), >= 0.75 at the end and at least 0.15 above where it started; the export, read at the
    tags as a plain causal LM, gives the trainer's last accuracy and loss.

    Measured (2-core AMD EPYC with AVX512-BF16): --seed 42 and 1-7, OMP_NUM_THREADS 1, and 2 for --seed 42
    and 3 (identical to every digit): after 31 steps 0.526-0.624, at the end 0.834-1.000 (this test's run:
    0.624 -> 0.925), rise 0.24-0.45; the bars sit below the lowest end and rise with 0.08 to spare. At lr 2e-3,
    seeds 42 and 1-4 ended at 0.810-0.940 (float noise decides how far the 0.5M model gets), with 0.649 after
    31 steps at one seed.
    ~20-30 s on 2 cores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = f"{assets}/data/count"
    out, metrics_file = tmp_path / "prm", tmp_path / "metrics.jsonl"
    run_script("rm.py", [
        "--pretrain", f"{assets}/llama-0.5m", "--dataset", f"{data}/prm_train.jsonl", "--eval_dataset",
        f"{data}/prm_test.jsonl", *PRM, "--train_batch_size", 32, "--micro_train_batch_size", 16, "--max_epochs", 3,
        "--learning_rate", 1e-3, "--seed", 42, "--eval_steps", 31, "--save_path", out, "--metrics_file", metrics_file,
    ], nproc=2)
    evals = [m for m in read_jsonl(metrics_file) if "eval/step_accuracy" in m]
    accuracy = [round(m["eval/step_accuracy"], 3) for m in evals]
    assert len(evals) == 9 and accuracy[0] < 0.7 and accuracy[-1] >= 0.75, accuracy
    assert accuracy[-1] - accuracy[0] >= 0.15, accuracy

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    tag, good, bad = (tokenizer.convert_tokens_to_ids(t) for t in (";", "+", "-"))
    correct = steps = 0
    nll = 0.0
    for row in read_jsonl(f"{data}/prm_test.jsonl"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                              {"role": "assistant", "content": row["response"]}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        p_good = torch.softmax(logits[[i for i, t in enumerate(ids) if t == tag]][:, [good, bad]], -1)[:, 0]
        labels = torch.tensor([1.0 if lab == "+" else 0.0 for lab in row["labels"]])
        correct += ((p_good > 0.5) == (labels > 0.5)).sum().item()
        nll -= (labels * p_good.log() + (1 - labels) * (1 - p_good).log()).sum().item()
        steps += len(labels)
    assert abs(correct / steps - evals[-1]["eval/step_accuracy"]) <= 1e-6
    assert abs(nll / steps - evals[-1]["eval/loss"]) <= 1e-4


# ----------------------------------------------------------------------------------------------
# common.infra.reward.score on a ZeRO-3 eval engine, two ranks with uneven work
# ----------------------------------------------------------------------------------------------
ZERO3_SEQS = [[11, 12, 13, 14, 1], [21, 22, 1], [31, 32, 33, 34, 35, 36, 1], [41, 42, 43, 1], [51, 1], [61, 62, 63, 1],
              [71, 72, 73, 74, 75, 1]]


def zero3_score_worker(model_dir, out_file):
    """Rank 0 scores 5 sequences, rank 1 scores 2 (batch size 2: 3 forwards against 1), with the
    model twice (weights 1 and 0.5) under a ZeRO-3 DeepSpeed eval engine."""
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from common.infra.engine import (
        ModelArgs, TrainArgs, create_eval_engine, deepspeed_eval_config, init_distributed, load_causal_lm,
    )

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    train = TrainArgs(zero_stage=3, micro_train_batch_size=2, train_batch_size=2 * world, param_dtype="fp32")
    ds_config = deepspeed_eval_config(train, world)
    engine = create_eval_engine(load_causal_lm(ModelArgs(pretrain=model_dir), ds_config,
                                               model_cls=AutoModelForSequenceClassification), ds_config)
    assert engine.zero_optimization_stage() == 3
    mine = ZERO3_SEQS[:5] if rank == 0 else ZERO3_SEQS[5:]
    rewards = score([engine, engine], mine, weights=[1.0, 0.5], batch_size=2)
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(rewards.tolist(), f)
    dist.destroy_process_group()


def test_score_with_zero3_eval_engine(rm_start, tmp_path):
    from transformers import AutoModelForSequenceClassification

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": PYTHONPATH}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, rm_start,
           str(tmp_path / "rewards")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "rewards.0").read_text()) + json.loads((tmp_path / "rewards.1").read_text())
    model = AutoModelForSequenceClassification.from_pretrained(rm_start).eval()
    expected = 1.5 * hf_rewards(model, ZERO3_SEQS, model.config.pad_token_id)
    assert (torch.tensor(got) - expected).abs().max().item() <= 1e-4, (got, expected)


# ----------------------------------------------------------------------------------------------
# Bad input and argument errors
# ----------------------------------------------------------------------------------------------
def test_reward_models_load_on_the_device_they_are_given(tiny_reward_model):
    """RL's reward-model actor (common.infra.cluster.RewardModels) and generate.py load rm.py's exports with
    load_reward_models on the device the process has (common.infra.engine.device(): the GPU Ray or torchrun gave
    it, else the CPU): the models sit on the device asked (meta: placed, nothing computed), and the actor's
    scores equal a plain CPU model's. tests/test_gpu_paths.py scores on CUDA."""
    from transformers import AutoModelForSequenceClassification

    from common.infra.cluster import RewardModels
    from common.infra.engine import device
    from common.infra.reward import load_reward_models

    models, tokenizer = load_reward_models([tiny_reward_model] * 2, torch.device("meta"))
    assert len(models) == 2 and tokenizer.name_or_path == tiny_reward_model
    assert {p.device.type for m in models for p in m.parameters()} == {"meta"} and not models[0].training
    actor = RewardModels([tiny_reward_model], False, False)
    assert {p.device for p in actor.models[0].parameters()} == {device()}
    prompts, responses = ["reverse: abc", "reverse: hello", "reverse: xy"], ["cba", "olleh", "yx"]
    ids = [reward_model_ids(actor.tokenizer, p, r, False) for p, r in zip(prompts, responses)]
    plain = score(AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval(), ids)
    assert plain.std() > 0.01 and actor.score(prompts, responses) == pytest.approx(plain.tolist(), abs=1e-5)


@pytest.mark.quick
def test_bad_rows(assets, tmp_path):
    from transformers import AutoTokenizer

    rm = load_algo("rm")
    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    args = pair_args()
    good = {"prompt": "reverse: a b c", "chosen": "c b a", "rejected": "a b c"}
    ids = rm.pair_row(good, tokenizer, args)["chosen_ids"]
    assert tokenizer.decode(ids) == "<|user|>\nreverse: a b c<|end|>\n<|assistant|>\nc b a<|end|>\n"
    cases = [
        ({"prompt": "reverse: a b c", "rejected": "a b c"}, "missing field 'chosen'"),
        ({**good, "rejected": "c b a"}, "fields 'chosen' and 'rejected' are identical"),
        ({**good, "rejected": " ".join("abcdefgh" * 8)}, "'rejected': \\d+ tokens, more than --max_len 64"),
    ]
    for row, message in cases:
        with pytest.raises(BadRow, match=message):
            rm.pair_row(row, tokenizer, args)
    with pytest.raises(BadRow, match="field 'margin' should be a number \\(--margin_loss\\), got None"):
        rm.pair_row(good, tokenizer, pair_args("--margin_loss"))

    args = prm_args()
    tag = tokenizer.convert_tokens_to_ids(";")
    step = {"prompt": "count: 1 to 4", "response": "2; 3; 5;", "labels": ["+", "+", "-"]}
    out = rm.step_row({**step, "labels": [1, 0.9, 0.0]}, tokenizer, args, tag, ("+", "-"))
    assert [(t, v) for t, v in zip(out["input_ids"],
                                   out["step_labels"]) if v >= 0] == [(tag, 1.0), (tag, 0.9), (tag, 0.0)]
    hard = rm.step_row(step, tokenizer, args, tag, ("+", "-"))["step_labels"]
    assert [v for v in hard if v >= 0] == [1.0, 1.0, 0.0]
    cases = [
        ({**step, "response": "2, 3, 5"}, "field 'response' has no step tag ';' \\(--placeholder_token\\)"),
        ({**step, "labels": ["+", "-"]}, "3 step tags ';' in the tokenized sample but 2 labels in field 'labels'"),
        ({**step, "labels": ["+", "?", "-"]}, "label '\\?' is not one of --reward_tokens \\('\\+', '-'\\)"),
        ({**step, "labels": [1, 1.5, 0]}, "label 1.5 is neither a reward token nor a probability in \\[0, 1\\]"),
    ]
    for row, message in cases:
        with pytest.raises(BadRow, match=message):
            rm.step_row(row, tokenizer, args, tag, ("+", "-"))

    # through the CLI: the file, row and reason, before any model loads; --skip_bad_rows counts them
    bad = tmp_path / "prm_bad.jsonl"
    bad.write_text(json.dumps(step) + "\n" + json.dumps({**step, "response": "2 3 5"}) + "\n")
    proc = run_script("rm.py", ["--pretrain", f"{assets}/llama-0.5m", "--dataset", bad, *PRM, "--train_batch_size", 8,
                                "--micro_train_batch_size", 8], expect_ok=False)
    assert f"{bad}: 1 bad row(s) of 2; first: row 1: field 'response' has no step tag ';'" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout
    kept = prepare_dataset(str(bad), "train", lambda r: rm.step_row(r, tokenizer, args, tag, ("+", "-")),
                           ("input_ids", "step_labels"), DataArgs(dataset=str(bad), skip_bad_rows=True, max_len=64,
                                                                  apply_chat_template=True), ["test_bad_rows"])
    assert len(kept) == 1


@pytest.mark.quick
def test_argument_errors(assets, monkeypatch):
    rm = load_algo("rm")
    required = ["--pretrain", "m", "--dataset", "d.jsonl"]
    errors = [
        (["--label_key", "steps"], "--label_key is for --prm only"),
        (["--placeholder_token", ";"], "--placeholder_token is for --prm only"),
        (["--input_key", "response"], "--input_key is for --prm only"),
        (["--prm", "--margin_loss"], "--margin_loss is for pairwise reward models only"),
        (["--prm", "--value_head_prefix", "value_head"], "--value_head_prefix is for pairwise reward models only"),
        (["--margin_key", "m"], "--margin_key is read only with --margin_loss"),
        (["--prm", "--reward_tokens", "+", "+"], "--reward_tokens must be two different tokens"),
        (["--input_template", "Q: {}"], "--input_template formats the prompt: set --prompt_key"),
        (["--max_len", "64", "--pack_max_tokens", "32"], "--pack_max_tokens 32 must be >= --max_len 64"),
        (["--aux_loss_coef", "0.01"], "--aux_loss_coef .MoE load balancing. is not implemented in rm.py"),
    ]
    for extra, message in errors:
        with pytest.raises(ValueError, match=message):
            rm.parse_args([*required, *extra])
    assert rm.parse_args([*required, "--prm", "--lora_rank", "8"]).model.lora_rank == 8  # LoRA PRMs are causal LMs

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    assert rm.single_token(tokenizer, ";", "--placeholder_token") == tokenizer.convert_tokens_to_ids(";")
    with pytest.raises(ValueError, match="--placeholder_token 'ки' is 4 tokens for this tokenizer"):
        rm.single_token(tokenizer, "ки", "--placeholder_token")
    with pytest.raises(ValueError, match="--value_head_prefix 'value_head': LlamaForSequenceClassification has no such "
                                         "linear head \\(its head: \\['score'\\]\\)"):
        rm.check_value_head(rm.parse_args(["--pretrain", f"{assets}/llama-0.5m", "--dataset", "d.jsonl",
                                           "--value_head_prefix", "value_head"]))


if __name__ == "__main__":
    zero3_score_worker(*sys.argv[1:])


def test_reward_models_score_the_ids_rm_py_trains_on(assets, tmp_path):
    """With a tokenizer that adds BOS (Llama's, Mistral's), generate.py, the RL rollout's reward-model actor and the
    reward server score prompt + response as the very ids rm.py trained the model on: BOS first and EOS last without
    a chat template; with one, the template's own text to its end of turn ("<|end|>\n" here)."""
    from tokenizers import processors
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.data import format_prompt, format_response
    from common.infra.cluster import RewardModels
    from common.infra.vllm_engine import Sample

    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    bos = "<|system|>"  # a special token no text encodes to stands in for <s>
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.bos_token = bos
    rm_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_pretrained(f"{assets}/llama-0.5m", num_labels=1).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    rm, gen = load_algo("rm"), load_algo("generate")
    prompt, response = "reverse: abc", "cba"

    def scored_ids(model, call):
        seen = []
        hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"][0].tolist()),
                                               with_kwargs=True)
        call()
        hook.remove()
        return seen

    for chat in ([], ["--apply_chat_template"]):
        rm_args = rm.parse_args(["--pretrain", rm_dir, "--dataset", "d.jsonl", "--prompt_key", "prompt", *chat])
        trained = rm.pair_row({"prompt": prompt, "chosen": response, "rejected": "bca"}, tokenizer, rm_args)
        trained = trained["chosen_ids"]
        assert (trained[0] == tokenizer.bos_token_id) != bool(chat)  # the tiny template writes no BOS
        gen_args = gen.parse_args(["--pretrain", rm_dir, "--dataset", "d.jsonl", "--output_path", "o.jsonl",
                                   "--reward_pretrain", rm_dir, *chat])
        data_args = DataArgs(dataset="d.jsonl", apply_chat_template=bool(chat))
        prompt_text = format_prompt(prompt, tokenizer, data_args)
        chunk = [{"prompt": prompt, "prompt_text": prompt_text, "label": None}]
        generate_scoring = lambda: gen.compute_rewards(  # noqa: E731
            gen_args, chunk, [[response]], [model], tokenizer, None)
        assert scored_ids(model, generate_scoring) == [trained], chat

        # the rollout: the policy's sample (ids to its EOS, text without it) -> the reward-model actor's ids
        from common.rollout import response_texts

        actor = RewardModels([rm_dir], normalize=False, apply_chat_template=bool(chat))
        ids = tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        sample = Sample(tokenizer(prompt_text, add_special_tokens=not chat)["input_ids"], ids, response,
                        [0.0] * len(ids), "stop")
        prompts = [{"prompt_text": prompt_text, "raw": prompt}]
        rollout_scoring = lambda: actor.score([prompt_text], response_texts(prompts, [[sample]], tokenizer,  # noqa: E731
                                                                            data_args))
        assert scored_ids(actor.models[0], rollout_scoring) == [trained], chat

        # the reward server: prompt + response text, the prompt given apart (as the RL and generate clients send)
        from launch.reward_server import ServeArgs, reward_fn_from_args

        query = prompt_text + (format_response(prompt, response, tokenizer, data_args) if chat else response)
        served = reward_fn_from_args(ServeArgs(reward_pretrain=rm_dir, apply_chat_template=bool(chat)))(
            [query], [prompt_text], [None])
        assert torch.allclose(served, score(model, [trained]), atol=1e-6), chat
