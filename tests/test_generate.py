"""algos/generate.py through its CLI: best-of-n, resume, rejection sampling (launch/rejection_sampling.sh) and
conditional SFT data that sft.py trains on, iterative-DPO pairs that dpo.py trains on (and launch/iterative_dpo.sh,
the loop over them), and bad input."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_jsonl, run_script

REWARD = os.path.join(ROOT, "launch", "rewards", "exact_match.py")


def gen_args(assets, model, out, *extra):
    return ["--pretrain", model, "--dataset", f"{assets}/data/reverse/rl_test.jsonl", "--input_key", "prompt",
            "--label_key", "answer", "--apply_chat_template", "--max_new_tokens", 12, "--temperature", 0.5,
            "--reward_func", REWARD, "--output_path", out, *extra]


def test_best_of_n_picks_argmax_and_resume_writes_no_duplicates(assets, sft_model, tmp_path):
    out = tmp_path / "gen.jsonl"
    common = gen_args(assets, sft_model, out, "--backend", "hf", "--best_of_n", 4, "--generate_batch_size", 4,
                      "--post_processor", "best_of_n")
    run_script("generate.py", [*common, "--max_samples", 8])
    first = read_jsonl(out)
    assert [r["index"] for r in first] == list(range(8))
    # a crash mid-write leaves a torn line: the resumed run drops it and goes on
    with open(out, "a") as f:
        f.write('{"index": 8, "prompt": "rev')
    proc = run_script("generate.py", [*common, "--max_samples", 12])
    assert "8 already in" in proc.stdout
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == list(range(12)) and rows[:8] == first
    for row in rows:
        assert len(row["responses"]) == 4 and len(row["rewards"]) == 4
        assert all(r == float(resp.strip() == row["label"]) for r, resp in zip(row["rewards"], row["responses"]))
    best = read_jsonl(tmp_path / "gen.best_of_n.jsonl")
    assert len(best) == 12
    for b, row in zip(best, rows):
        k = max(range(4), key=lambda i: row["rewards"][i])
        assert b["reward"] == max(row["rewards"]) and b["response"] == row["responses"][k]
    # the partly trained policy is right sometimes: best-of-4 beats the mean sample
    assert sum(b["reward"] for b in best) > sum(sum(r["rewards"]) for r in rows) / 4


def test_rejection_sampling_and_csft_data_train_with_sft(assets, sft_model, tmp_path):
    """launch/rejection_sampling.sh, one round (4 samples on 64 prompts -> exact-match reward -> the best per prompt
    at reward 1 -> SFT from the policy); then conditional-SFT data from the same generations trains sft.py."""
    loop = tmp_path / "loop"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           "PY": sys.executable, "POLICY": sft_model, "PROMPTS": f"{assets}/data/reverse/rl_test.jsonl",
           "OUT": str(loop), "ITERS": "1", "PROMPTS_PER_ITER": "64", "N": "4",
           "GEN_ARGS": "--input_key prompt --apply_chat_template --max_new_tokens 12 --temperature 0.5 "
                       "--max_model_len 128",
           "SFT_ARGS": "--input_key prompt --output_key response --apply_chat_template --max_len 128 "
                       "--train_batch_size 4 --micro_train_batch_size 4 --max_epochs 4 --learning_rate 5e-4 "
                       f"--metrics_file {tmp_path / 'rs.jsonl'}"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "rejection_sampling.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "reward: mean" in proc.stdout and f"final policy: {loop}/model_0" in proc.stdout
    rs = read_jsonl(loop / "gen_0.rs.jsonl")
    assert 8 <= len(rs) <= 64 and all(r["reward"] == 1.0 and r["response"].strip() == r["label"] for r in rs)
    losses = [m["train/loss"] for m in read_jsonl(tmp_path / "rs.jsonl")]
    assert losses[-1] < 0.7 * losses[0], losses  # measured 0.688 -> 0.390 (lr 5e-4 from the policy)
    assert os.path.exists(loop / "model_0" / "config.json")

    # conditional SFT from the same generations (no new sampling: every prompt is already written)
    proc = run_script("generate.py", gen_args(assets, sft_model, loop / "gen_0.jsonl", "--best_of_n", 4,
                                              "--rollout_batch_size", 64, "--iter", 0, "--post_processor", "csft"))
    assert "0 to generate" in proc.stdout
    csft = read_jsonl(loop / "gen_0.csft.jsonl")
    assert len(csft) == 64 * 4
    rewards = [r["reward"] for r in csft]
    mean = sum(rewards) / len(rewards)
    assert all(r["prompt"].startswith("<rm_score>: ") for r in csft)
    assert any(r["prompt"].startswith("<rm_score>: -") for r in csft if r["reward"] < mean)
    sft_common = ["--pretrain", f"{assets}/llama-0.5m", "--input_key", "prompt", "--output_key", "response",
                  "--apply_chat_template", "--max_len", 128, "--train_batch_size", 4, "--micro_train_batch_size", 4,
                  "--max_epochs", 4, "--learning_rate", 3e-3]
    run_script("sft.py", [*sft_common, "--dataset", loop / "gen_0.csft.jsonl", "--max_samples", 64,
                          "--save_path", tmp_path / "sft_csft", "--metrics_file", tmp_path / "csft.jsonl"])
    losses = [m["train/loss"] for m in read_jsonl(tmp_path / "csft.jsonl")]
    assert losses[-1] < 0.7 * losses[0], losses


def test_iterative_dpo_pairs_train_with_dpo(assets, sft_model, tmp_path):
    out = tmp_path / "gen.jsonl"
    run_script("generate.py", gen_args(assets, sft_model, out, "--backend", "hf", "--best_of_n", 4, "--max_samples",
                                       128, "--post_processor", "iter_dpo", "--iter", 1, "--rollout_batch_size", 64))
    assert [r["index"] for r in read_jsonl(out)] == list(range(64, 128))  # the --iter 1 slice
    pairs = read_jsonl(tmp_path / "gen.iter_dpo.jsonl")
    assert len(pairs) >= 8 and all(p["chosen"].strip() != p["rejected"].strip() and p["margin"] == 1.0 for p in pairs)
    run_script("dpo.py", ["--pretrain", sft_model, "--dataset", tmp_path / "gen.iter_dpo.jsonl",
                          "--apply_chat_template",
                          "--max_len", 128, "--train_batch_size", 4, "--micro_train_batch_size", 4, "--max_epochs", 4,
                          "--learning_rate", 1e-4, "--save_path", tmp_path / "dpo", "--metrics_file",
                          tmp_path / "dpo.jsonl"])
    losses = [m["train/loss"] for m in read_jsonl(tmp_path / "dpo.jsonl")]
    steps_per_epoch = len(pairs) // 4
    assert abs(losses[0] - 0.6931) <= 1e-3  # policy = reference at the first step: log 2
    last_epoch = losses[-steps_per_epoch:]
    assert sum(last_epoch) / len(last_epoch) < 0.675, losses  # measured 0.654 (from log 2 = 0.693)


@pytest.mark.quick
def test_bad_input(assets, sft_model, tmp_path):
    bad_reward = tmp_path / "reward.py"
    bad_reward.write_text("def score(queries):\n    return [0.0] * len(queries)\n")
    proc = run_script("generate.py", gen_args(assets, sft_model, tmp_path / "a.jsonl")[:-4] +
                      ["--reward_func", bad_reward, "--output_path", tmp_path / "a.jsonl"], expect_ok=False)
    assert proc.returncode != 0 and "defines no function reward_func(queries, prompts, labels)" in proc.stderr
    proc = run_script("generate.py", gen_args(assets, sft_model, tmp_path / "b.jsonl", "--backend", "hf", "--iter", 99,
                                              "--rollout_batch_size", 100), expect_ok=False)
    assert proc.returncode != 0 and "no prompts to generate from" in proc.stderr
    proc = run_script("generate.py", gen_args(assets, sft_model, tmp_path / "c.jsonl", "--post_processor", "iter_dpo"),
                      expect_ok=False)
    assert "--post_processor iter_dpo needs --best_of_n >= 2" in proc.stderr
    assert not os.path.exists(tmp_path / "c.jsonl")


def held_out_exact_match(assets, model, out):
    """Greedy exact match (the mean exact_match.py reward) over the 200 held-out reversal prompts."""
    run_script("generate.py", ["--pretrain", model, "--dataset", f"{assets}/data/reverse/rl_test.jsonl",
                               "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template",
                               "--max_new_tokens", 16, "--temperature", 0, "--reward_func", REWARD, "--backend", "hf",
                               "--output_path", out])
    rows = read_jsonl(out)
    assert len(rows) == 200
    return sum(r["rewards"][0] for r in rows) / len(rows)


def test_iterative_dpo_loop_raises_held_out_reward(assets, rl_start_model, tmp_path):
    """launch/iterative_dpo.sh, 2 iterations of (4 samples on 128 new train prompts -> exact-match reward ->
    best vs worst pairs -> DPO from the previous round's model), raises held-out greedy exact match."""
    out = tmp_path / "loop"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           "PY": sys.executable,
           "POLICY": rl_start_model, "PROMPTS": f"{assets}/data/reverse/rl_train.jsonl", "OUT": str(out),
           "ITERS": "2", "PROMPTS_PER_ITER": "128", "N": "4",
           # HF generate: at this size faster than starting a vLLM engine on CPU (20 s vs 77 s per call)
           "GEN_ARGS": "--input_key prompt --apply_chat_template --max_new_tokens 16 --temperature 1.0 --backend hf",
           # lr 5e-5 with an NLL term on the chosen (correct) response; measured on the held-out set:
           # pure DPO at lr 1e-4 went 0.66 -> 0.705 -> 0.72 with seed 42 but 0.66 -> 0.575 -> 0.615 with seed 1;
           # lr 3e-4 -> 0.49 -> 0.595, the script's default lr 1e-3 collapses (7 pairs left in round 2)
           "DPO_ARGS": "--apply_chat_template --max_len 128 --train_batch_size 8 --micro_train_batch_size 4 "
                       "--max_epochs 2 --learning_rate 5e-5 --nll_loss_coef 1.0"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "iterative_dpo.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("reward: mean") == 2 and f"final policy: {out}/model_1" in proc.stdout
    for k in range(2):  # round k trained on its own slice of the prompts, with best (reward 1) vs worst (0) pairs
        assert [r["index"] for r in read_jsonl(out / f"gen_{k}.jsonl")] == list(range(128 * k, 128 * (k + 1)))
        pairs = read_jsonl(out / f"gen_{k}.iter_dpo.jsonl")
        assert len(pairs) >= 16 and all(p["margin"] == 1.0 for p in pairs)
    before = held_out_exact_match(assets, rl_start_model, tmp_path / "eval_start.jsonl")
    after = held_out_exact_match(assets, str(out / "model_1"), tmp_path / "eval_1.jsonl")  # the loop's final policy
    # measured by hand (engine/DPO seed 42): 0.66 -> 0.725 -> 0.73; (seed 1): 0.66 -> 0.75 -> 0.745
    assert after >= before + 0.04, (before, after)
