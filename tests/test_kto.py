"""algos/kto.py: loss and KL reference point by hand, rows (unpaired, paired, bad), cached = live
reference, one step equal across ZeRO stages / packing / reference modes (and to a plain padded
implementation), a run on desirable examples only, learning under torchrun, and bad input."""

import json
import math
import os

import pytest
import torch
from conftest import load_algo, max_weight_diff, read_jsonl, run_script, run_scripts

from common.logprobs import response_logps
from common.packing import Layout

PADDED = Layout(one_row=False, share_prefixes=False)  # the sdpa kernel: bounded rows

TASK = ["--apply_chat_template", "--max_len", "64"]


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def kto_args(kto, **kwargs):
    return kto.Args(data=kto.KTODataArgs(apply_chat_template=True, max_len=64), **kwargs)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.quick
def test_loss_and_kl_reference_point_by_hand():
    kto = load_algo("kto")
    # z: mean log-ratio of the mismatched pairs, [1, 0.5, -1] -> 1/6; clamped at 0 when negative
    z = kto.kl_reference_point(torch.tensor([-5.0, -3.0, -4.0]), torch.tensor([-6.0, -3.5, -3.0]))
    assert abs(z.item() - 1 / 6) <= 1e-6
    assert kto.kl_reference_point(torch.tensor([-5.0, -3.0]), torch.tensor([-4.0, -3.5])).item() == 0.0

    # r = log π - log π_ref = [1, -1, 0], labels desirable / undesirable / desirable, β 0.5, λ_D 1, λ_U 2
    logps, ref = torch.tensor([-2.0, -6.0, -4.0]), torch.tensor([-3.0, -5.0, -4.0])
    labels = torch.tensor([True, False, True])
    losses, rewards = kto.kto_loss(logps, ref, labels, z, 0.5, desirable_weight=1.0, undesirable_weight=2.0)
    expected = [1 - sigmoid(0.5 * (1 - 1 / 6)), 2 * (1 - sigmoid(0.5 * (1 / 6 + 1))), 1 - sigmoid(0.5 * (0 - 1 / 6))]
    assert torch.allclose(losses, torch.tensor(expected)), (losses, expected)
    assert torch.allclose(rewards, torch.tensor([0.5, -0.5, 0.0]))
    # a batch of desirable examples only: the undesirable term is empty, nothing else changes
    losses, _ = kto.kto_loss(logps[[0, 2]], ref[[0, 2]], labels[[0, 2]], z, 0.5, 1.0, 2.0)
    assert torch.allclose(losses, torch.tensor([expected[0], expected[2]]))
    # at initialisation (policy = reference) r = 0 and z = 0: every loss is λ/2
    losses, _ = kto.kto_loss(ref, ref, labels, torch.tensor(0.0), 0.1, 1.0, 2.0)
    assert torch.allclose(losses, torch.tensor([0.5, 1.0, 0.5]))
    # the mismatched pairs of a micro-batch: prompt k with the completion of example k + 1
    assert kto.kl_pairs([7, 3, 9]) == [(7, 3), (3, 9), (9, 7)]


@pytest.mark.quick
def test_rows_unpaired_paired_and_bad(assets):
    from transformers import AutoTokenizer

    kto = load_algo("kto")
    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    args = kto_args(kto)
    one = kto.kto_row({"prompt": "reverse: a b", "completion": "b a", "label": False}, tokenizer, args)
    assert one["label"] == [False] and one["paired"] == [False]
    assert tokenizer.decode(one["completion_ids"][0]) == "b a<|end|>\n"
    two = kto.kto_row({"prompt": "reverse: a b", "chosen": "b a", "rejected": "a b"}, tokenizer, args)
    assert two["label"] == [True, False] and two["paired"] == [True, True]
    assert two["prompt_ids"][0] == two["prompt_ids"][1]
    assert [tokenizer.decode(c) for c in two["completion_ids"]] == ["b a<|end|>\n", "a b<|end|>\n"]
    good = {"prompt": "reverse: a b", "completion": "b a", "label": True}
    for row, message in [
        ({**good, "label": 1}, "field 'label' should be bool, got int"),
        ({**good, "label": "true"}, "field 'label' should be bool, got str"),
        ({**good, "completion": ""}, "field 'completion' is empty"),
        ({"prompt": "reverse: a b", "label": True},
         "a row needs 'completion' and 'label' \\(unpaired\\) or 'chosen' and 'rejected'"),
        ({"prompt": "reverse: a b", "completion": "b a"}, "missing field 'label'"),
        ({"prompt": "reverse: a b", "chosen": "b a"}, "missing field 'rejected'"),
        ({"completion": "b a", "label": True}, "missing field 'prompt'"),
        ({"prompt": "reverse: a b", "chosen": [{"role": "assistant", "content": "b a"}], "rejected": "a b"},
         "field 'chosen' should be a string"),
        ({**good, "completion": "b a " * 40}, "prompt \\+ 'completion' is .* tokens, more than --max_len 64"),
    ]:
        with pytest.raises(kto.BadRow, match=message):
            kto.kto_row(row, tokenizer, args)
    # flattening: a paired row becomes two consecutive examples, an unpaired row one
    import datasets

    ds = kto.one_example_per_row(datasets.Dataset.from_list([one, two, one]))
    assert ds["label"] == [False, True, False, False] and ds["paired"] == [False, True, True, False]
    # a mismatched pair's completion is cut to fit --max_len
    long = {"prompt_ids": [[1] * 50, [2] * 5], "completion_ids": [[3] * 10, [4] * 30]}
    samples = kto.kto_samples(datasets.Dataset.from_dict(long), [(0, 1), (1, 1)], 64)
    assert samples[0]["input_ids"] == [1] * 50 + [4] * 14 and samples[0]["loss_mask"] == [0] * 50 + [1] * 14
    assert samples[1]["input_ids"] == [2] * 5 + [4] * 30

    with pytest.raises(ValueError, match="--micro_train_batch_size must be >= 2"):
        kto.parse_args(["--pretrain", "m", "--dataset", "d.jsonl", "--train_batch_size", "1",
                        "--micro_train_batch_size", "1"])


def test_cached_reference_equals_live(assets, sft_model):
    """The cache pass (examples and mismatched pairs sharded, micro-batches of 16) gives the reference
    log-probs a live reference computes inside training micro-batches (examples + their mismatched
    pairs in one packed forward), to 1e-5."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kto = load_algo("kto")
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    model = AutoModelForCausalLM.from_pretrained(sft_model, attn_implementation="sdpa").eval()
    args = kto_args(kto)
    raw = rows(f"{assets}/data/reverse/unpaired_train.jsonl")[:48]
    ds = kto.one_example_per_row(datasets.Dataset.from_list([kto.kto_row(r, tokenizer, args) for r in raw]))
    batch_fn = lambda samples: kto.make_batch(samples, args, tokenizer.pad_token_id, PADDED)  # noqa: E731
    order = torch.randperm(48, generator=torch.Generator().manual_seed(0)).tolist()
    micro_batches = [order[k : k + 6] for k in range(0, 48, 6)]
    items = [(i, i) for i in range(48)] + [p for idx in micro_batches for p in kto.kl_pairs(idx)]
    samples_of = lambda pos: kto.kto_samples(ds, [items[p] for p in pos], 64)  # noqa: E731
    cached = kto.sharded_logps(model, len(items), samples_of, 16, batch_fn, "cpu")[:, 0]
    position = {item: p for p, item in enumerate(items)}
    worst = 0.0
    with torch.no_grad():
        for idx in micro_batches:
            pairs = [(i, i) for i in idx] + kto.kl_pairs(idx)
            live, _ = response_logps(model, batch_fn(kto.kto_samples(ds, pairs, 64)))
            worst = max(worst, (live - cached[[position[p] for p in pairs]]).abs().max().item())
    assert worst <= 1e-5, worst
    assert (cached < 0).all()


def test_one_step_equal_across_zero_packing_reference_modes(assets, sft_model, tmp_path):
    """One optimizer step on 8 unpaired examples (4 desirable, λ_D 1; 4 undesirable, λ_U 1.5): cached
    reference, micro-batch of 8, ZeRO-0 is the base.  Padded rows (1e-4), and a live reference under
    ZeRO-3 on 2 ranks x micro 4 (1e-5) give the same loss, gradient norm and weights; the base's loss is
    the hand value (λ_D + λ_U) / 4 and its gradient norm that of a plain padded implementation."""
    data = f"{assets}/data/reverse/unpaired_train.jsonl"
    common = ["--pretrain", sft_model, "--dataset", data, *TASK, "--max_samples", 8, "--train_batch_size", 8,
              "--learning_rate", 1e-4, "--max_norm", 0, "--seed", 1, "--beta", 0.1, "--undesirable_loss_weight", 1.5]
    runs = {"base": (1, 8, 0, []), "padded": (1, 8, 0, ["--no_packing_samples"]),
            "zero3_live": (2, 4, 3, ["--no_ref_cache"])}  # orthogonal options share a run
    run_scripts([("kto.py", [*common, "--micro_train_batch_size", micro, "--zero_stage", zero, *extra,
                              "--save_path", tmp_path / name, "--metrics_file", tmp_path / f"{name}.jsonl"],
                  {"nproc": nproc}) for name, (nproc, micro, zero, extra) in runs.items()])
    results = {}
    for name in runs:
        (results[name],) = read_jsonl(tmp_path / f"{name}.jsonl")

    # the plain implementation: padded rows, reference = the same weights, so r = 0 and z = 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.logprobs import token_logps
    from common.packing import collate

    kto = load_algo("kto")
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    model = AutoModelForCausalLM.from_pretrained(sft_model, attn_implementation="sdpa")
    examples = [kto.kto_row(r, tokenizer, kto_args(kto)) for r in rows(data)[:8]]
    batch = collate([{"input_ids": e["prompt_ids"][0] + e["completion_ids"][0],
                      "loss_mask": [0] * len(e["prompt_ids"][0]) + [1] * len(e["completion_ids"][0])}
                     for e in examples],
                    tokenizer.pad_token_id, packing=False)
    logps, _ = token_logps(model, batch)
    logps = (logps * batch["loss_mask"]).sum(-1)
    labels = torch.tensor([e["label"][0] for e in examples])
    assert labels.sum().item() == 4
    losses, _ = kto.kto_loss(logps, logps.detach(), labels, torch.tensor(0.0), 0.1, 1.0, 1.5)
    losses.mean().backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()

    base = results["base"]
    assert abs(base["train/loss"] - (1.0 + 1.5) / 4) <= 1e-6, base["train/loss"]
    assert abs(base["train/kl"]) <= 1e-6
    assert abs(base["train/logps/desirable"] - logps[labels].mean().item()) <= 1e-5
    assert abs(base["train/grad_norm"] - grad_norm) <= 1e-5 * grad_norm, (base["train/grad_norm"], grad_norm)
    for name, tol in [("padded", 1e-4), ("zero3_live", 1e-5)]:
        m = results[name]
        for key in ("train/loss", "train/kl", "train/logps/desirable", "train/logps/undesirable",
                    "train/logps/ref_desirable", "train/logps/ref_undesirable"):
            assert abs(m[key] - base[key]) <= tol, (name, key, m[key], base[key])
        assert abs(m["train/grad_norm"] - base["train/grad_norm"]) <= tol * base["train/grad_norm"], name
        assert max_weight_diff(tmp_path / name, tmp_path / "base") <= tol, name
    assert max_weight_diff(tmp_path / "base", sft_model) > 5e-5  # the step did move the weights


def test_desirable_examples_only(assets, sft_model, tmp_path):
    """Only desirable examples (λ_D 2), 2 ranks: KTO runs (the undesirable term is empty), the first loss
    is λ_D / 2, every loss lies in (0, λ_D), z >= 0, no undesirable metric is logged, and the weights move."""
    only = tmp_path / "desirable.jsonl"
    only.write_text(
        "".join(json.dumps(r) + "\n" for r in rows(f"{assets}/data/reverse/unpaired_train.jsonl") if r["label"]))
    run_script("kto.py", ["--pretrain", sft_model, "--dataset", only, *TASK, "--max_samples", 48, "--train_batch_size",
                          16,
                          "--micro_train_batch_size", 4, "--learning_rate", 1e-4, "--desirable_loss_weight", 2.0,
                          "--save_path", tmp_path / "out", "--metrics_file", tmp_path / "m.jsonl"], nproc=2)
    metrics = read_jsonl(tmp_path / "m.jsonl")
    assert len(metrics) == 3
    assert abs(metrics[0]["train/loss"] - 1.0) <= 1e-6
    assert all(0 < m["train/loss"] < 2.0 and m["train/kl"] >= 0 and m["train/grad_norm"] > 0 for m in metrics), metrics
    assert not any(k.endswith("undesirable") for m in metrics for k in m)
    assert max_weight_diff(tmp_path / "out", sft_model) > 1e-4


def test_kto_learns_and_exports(assets, sft_model, tmp_path):
    """2 ranks, one epoch (62 steps of 32) of the unpaired examples from the SFT model, evaluated on
    held-out preference pairs (split into desirable / undesirable).  Measured (2 CPU cores):
    implicit-reward accuracy 0 at start (all rewards are 0 but for float noise), 0.95 after (0.89 after
    32 steps, hence the full epoch); log-prob margin chosen - rejected 3.35 -> 8.5; the reference
    point z stays 0 (the policy's mismatched log-ratios turn negative)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.logprobs import token_logps
    from common.packing import collate
    from launch.tiny import exact_match

    data = f"{assets}/data/reverse"
    out, metrics_file = tmp_path / "model", tmp_path / "metrics.jsonl"
    proc = run_script("kto.py", [
        "--pretrain", sft_model, "--dataset", f"{data}/unpaired_train.jsonl", "--eval_dataset",
        f"{data}/pref_test.jsonl",
        *TASK, "--train_batch_size", 32, "--micro_train_batch_size", 8, "--learning_rate", 3e-4, "--beta", 0.1,
        "--save_path", out, "--metrics_file", metrics_file,
    ], nproc=2)
    assert "2000 training examples: 1000 desirable, 1000 undesirable" in proc.stdout
    metrics = read_jsonl(metrics_file)
    assert len(metrics) == 62
    first, last = metrics[0], metrics[-1]
    assert abs(first["train/loss"] - 0.5) <= 1e-5 and abs(first["train/rewards/desirable"]) <= 1e-5
    assert last["eval/rewards/accuracy"] >= 0.85, last["eval/rewards/accuracy"]
    ref_margin = last["eval/logps/ref_desirable"] - last["eval/logps/ref_undesirable"]
    margin = last["eval/logps/desirable"] - last["eval/logps/undesirable"]
    assert margin >= ref_margin + 3.0, (margin, ref_margin)
    assert last["eval/rewards/margin"] > 0.3 and last["eval/kl"] >= 0

    # the export reloads, reproduces the trainer's held-out log-probs and generates answers
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    kto = load_algo("kto")
    pairs = [kto.kto_row(r, tokenizer, kto_args(kto)) for r in rows(f"{data}/pref_test.jsonl")]
    with torch.no_grad():
        batch = collate([{"input_ids": p["prompt_ids"][0] + p["completion_ids"][0],
                          "loss_mask": [0] * len(p["prompt_ids"][0]) + [1] * len(p["completion_ids"][0])}
                         for p in pairs],
                        tokenizer.pad_token_id, packing=False)
        logps, _ = token_logps(model, batch)
    hf_chosen = (logps * batch["loss_mask"]).sum(-1).mean().item()
    assert abs(hf_chosen - last["eval/logps/desirable"]) <= 1e-4, (hf_chosen, last["eval/logps/desirable"])
    # greedy answers: 0 exact for the untrained model, 0.09 for the SFT start, measured 0.08 after KTO
    assert exact_match(model, tokenizer, rows(f"{data}/sft_test.jsonl")) >= 0.04


def test_resume_reproduces_uninterrupted_run(assets, sft_model, tmp_path):
    """Checkpoints at steps 2 and 4 of 4; resuming from step 2 (the cached reference recomputed at the
    start) gives the same losses for steps 3-4 and the same final weights, to 1e-6."""
    import shutil

    common = ["--pretrain", sft_model, "--dataset", f"{assets}/data/reverse/unpaired_train.jsonl", *TASK,
              "--max_samples", 64,
              "--train_batch_size", 16, "--micro_train_batch_size", 4, "--learning_rate", 3e-4, "--save_steps", 2]
    full = tmp_path / "full_ckpt"
    run_script("kto.py", [*common, "--ckpt_path", full, "--save_path", tmp_path / "full", "--metrics_file",
                          tmp_path / "full.jsonl"], nproc=2)
    resumed = tmp_path / "resumed_ckpt"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "global_step4")
    (resumed / "latest").write_text("global_step2")
    proc = run_script("kto.py", [*common, "--ckpt_path", resumed, "--load_checkpoint", "--save_path",
                                 tmp_path / "resumed",
                                 "--metrics_file", tmp_path / "resumed.jsonl"], nproc=2)
    assert "resumed from" in proc.stdout
    full_losses = {m["step"]: m["train/loss"] for m in read_jsonl(tmp_path / "full.jsonl")}
    resumed_losses = {m["step"]: m["train/loss"] for m in read_jsonl(tmp_path / "resumed.jsonl")}
    assert sorted(resumed_losses) == [3, 4]
    for step, loss in resumed_losses.items():
        assert abs(loss - full_losses[step]) <= 1e-6, (step, loss, full_losses[step])
    assert abs(full_losses[4] - full_losses[1]) > 1e-3  # training moved the loss
    assert max_weight_diff(tmp_path / "resumed", tmp_path / "full") <= 1e-6


@pytest.mark.quick
def test_bad_input_through_the_cli(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = [{"prompt": "reverse: a b", "completion": "b a", "label": True},
            {"prompt": "reverse: a b", "completion": "a b", "label": False}]
    wrong = {"prompt": "reverse: c d", "completion": "d c", "label": "yes"}
    bad.write_text("".join(json.dumps(r) + "\n" for r in good * 3 + [wrong]))
    cli = ["--pretrain", f"{assets}/llama-0.5m", "--dataset", bad, *TASK, "--train_batch_size", 4,
           "--micro_train_batch_size", 2, "--save_path", tmp_path / "out", "--metrics_file", tmp_path / "m.jsonl"]
    proc = run_script("kto.py", cli, expect_ok=False)
    assert proc.returncode != 0
    assert f"{bad}: 1 bad row(s) of 7; first: row 6: field 'label' should be bool, got str" in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout
    proc = run_script("kto.py", [*cli, "--skip_bad_rows", "--lr_scheduler", "linear", "--lr_warmup_ratio", 0])
    assert f"{bad}: skipped 1 bad row(s) of 7" in proc.stdout
    assert "6 training examples: 3 desirable, 3 undesirable" in proc.stdout
    metrics = read_jsonl(tmp_path / "m.jsonl")
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["train/lr"] == 5e-7  # the rate the step used (read before it; linear decay to 0 after)
    assert os.path.exists(tmp_path / "out" / "model.safetensors")
