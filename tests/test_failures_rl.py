"""Failure paths of the scripts that run vLLM engines (grpo.py, generate.py, distill.py on-policy):
an engine that cannot start, or a role killed mid-run, ends the run within a minute with exit code
!= 0, one `error:` line naming the role and the root cause, and no process left behind."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import ROOT, read_jsonl
from test_grpo import grpo_args

# 400,000 sequences of 128 tokens (--max_model_len 128 in these runs) of the 0.4M model: a 107 GiB KV cache,
# more than any machine of this kind has, whatever its NUMA node reports
IMPOSSIBLE_KV = ["--vllm_max_num_seqs", 400_000]


def tagged_env():
    """An environment whose tag every process of the run inherits (Ray's, vLLM's, torchrun's)."""
    tag = uuid.uuid4().hex
    return tag, {**os.environ, "MINRLHF_TEST_TAG": tag, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                 "WANDB_MODE": "offline"}


def _tag_of(process):
    try:
        return process.environ().get("MINRLHF_TEST_TAG")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def processes_of(tag):
    return [f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}" for p in psutil.process_iter(["pid", "cmdline"])
            if _tag_of(p) == tag]


def assert_none_left(tag, within_s=15):
    deadline = time.time() + within_s
    while processes_of(tag) and time.time() < deadline:
        time.sleep(0.5)
    assert not processes_of(tag), processes_of(tag)


def run_tagged(script, args, timeout=300, nproc=1):
    tag, env = tagged_env()
    path = os.path.join(ROOT, "algos", script)
    cmd = [sys.executable, path] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc_per_node", str(nproc), path]
    start = time.time()
    proc = subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.time() - start, tag


def without_eval(args):
    """grpo_args without --eval_dataset: no held-out evaluation (200 prompts) before step 1 of a run that is to fail."""
    at = args.index("--eval_dataset")
    return args[:at] + args[at + 2:]


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def test_grpo_engine_that_cannot_start(assets, tmp_path):
    """A KV-cache budget no machine of this kind holds (IMPOSSIBLE_KV: 107 GiB on 24 GiB machines): the
    driver stops as soon as the engine actor dies (before any rendezvous), naming it and vLLM's own
    first error line."""
    args = without_eval(grpo_args(assets, f"{assets}/llama-0.5m", tmp_path, "--rollout_batch_size", 16,
                                  "--train_batch_size", 64, "--max_steps", 1,
                                  *IMPOSSIBLE_KV))
    proc, seconds, tag = run_tagged("grpo.py", args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = error_lines(proc)
    print(f"{seconds:.1f} s: {errors}")
    assert len(errors) == 1 and errors[0].startswith("error: vLLM engine 0 failed to start: "), errors
    assert "ValueError: Available memory on node" in errors[0], errors
    # Ray ~3 s + the engine's attempt (~20 s on AVX512 CPUs, ~50 s on AVX2-only ones); far below the 600 s rendezvous
    assert seconds < 240, seconds
    assert_none_left(tag)


def test_grpo_trainer_killed_mid_run(assets, rl_start_model, tmp_path):
    """SIGKILL one trainer actor (as the OOM killer would) once the run is training: the driver ends
    within 60 s naming the trainer, and every process of the run is gone."""
    args = without_eval(grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 16, "--train_batch_size",
                                  64, "--max_steps", 200, "--actor_num_gpus_per_node", 2))
    tag, env = tagged_env()
    log = open(tmp_path / "grpo.log", "w+")  # a file, not a pipe nobody reads while the run logs
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "algos", "grpo.py")] + [str(a) for a in args], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (os.path.exists(tmp_path / "metrics.jsonl") and
                                              any("train/reward" in m for m in read_jsonl(tmp_path / "metrics.jsonl"))):
            assert proc.poll() is None, (tmp_path / "grpo.log").read_text()[-3000:]
            time.sleep(1)
        trainers = [p for p in psutil.process_iter(["pid", "cmdline"])
                    if "ray::TrainerRank" in " ".join(p.info["cmdline"] or []) and _tag_of(p) == tag]
        assert len(trainers) == 2, processes_of(tag)
        trainers[0].send_signal(signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=120)
        seconds = time.time() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    stderr = (tmp_path / "grpo.log").read_text()
    assert proc.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    print(f"{seconds:.1f} s after the kill: {errors}")
    assert len(errors) == 1 and re.match(r"error: trainer rank [01] failed: .*its process died", errors[0]), errors
    assert seconds < 60, seconds
    assert_none_left(tag)


def test_grpo_stops_at_a_broken_weight_sync(assets, rl_start_model, tmp_path):
    """The sync after step 1 sends one weight negated (a test-only switch of common.infra.weight_sync): step 2's
    samples come from other weights than the trainer's, and the run stops there naming the step, the measured gap and
    --max_mismatch_kl, with step 1 logged healthy (fp32: a mismatch KL far below the bound)."""
    from common.infra.weight_sync import CORRUPT_WEIGHT_VARIABLE

    args = without_eval(grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 16, "--train_batch_size",
                                  64, "--max_steps", 3))
    tag, env = tagged_env()
    env[CORRUPT_WEIGHT_VARIABLE] = "model.norm.weight"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "algos", "grpo.py")] + [str(a) for a in args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = error_lines(proc)
    print(errors)
    want = "error: step 2: vLLM sampled from other weights than the trainer's (a broken weight sync or model load)"
    assert len(errors) == 1 and errors[0].startswith(want), errors
    gap = float(re.search(r"mismatch KL ([0-9.e+-]+) > --max_mismatch_kl 0.1", errors[0]).group(1))
    steps = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "train/reward" in m]
    assert [m["step"] for m in steps] == [1] and steps[0]["rollout/mismatch_kl"] <= 1e-8 < 1 <= gap, (steps, gap)
    assert_none_left(tag)


@pytest.fixture(scope="module")
def head_dim_16_model(assets, tmp_path_factory):
    """A Llama that transformers runs but vLLM's CPU attention refuses (head_dim 16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("head_dim_16")
    config = AutoConfig.from_pretrained(f"{assets}/llama-0.5m")
    config.num_attention_heads = config.num_key_value_heads = 8
    config.head_dim = 16
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m").save_pretrained(path)
    return str(path)


def test_generate_model_vllm_rejects(assets, head_dim_16_model, tmp_path):
    """A model whose head size vLLM's CPU attention has no kernel for: generate.py ends with one
    `error:` line carrying vLLM's own reason, and the engine's processes are gone."""
    proc, seconds, tag = run_tagged("generate.py", [
        "--pretrain", head_dim_16_model, "--dataset", f"{assets}/data/reverse/rl_test.jsonl", "--input_key", "prompt",
        "--apply_chat_template", "--max_samples", 4, "--output_path", tmp_path / "gen.jsonl"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = error_lines(proc)
    print(f"{seconds:.1f} s: {errors}")
    # with an explicit KV-cache size vLLM skips its warm-up pass, so the kernel refuses at the first batch
    assert len(errors) == 1 and errors[0].startswith(f"error: vLLM engine for {head_dim_16_model} failed while "
                                                     "generating: RuntimeError: Unsupported CPU attention"), errors
    assert "head_dim=16" in errors[0], errors
    assert seconds < 90, seconds
    assert_none_left(tag)


def test_distill_on_policy_engine_that_cannot_start(assets, tmp_path):
    """Rank 0's on-policy engine cannot start (IMPOSSIBLE_KV, as in the grpo test): both torchrun ranks
    end, and one `error:` line carries vLLM's own reason."""
    data = f"{assets}/data/reverse"
    proc, seconds, tag = run_tagged("distill.py", [
        "--pretrain", f"{assets}/llama-0.5m", "--teacher_model", f"{assets}/llama-0.5m", "--dataset",
        f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key", "response", "--apply_chat_template",
        "--max_len", 64, "--max_samples", 32, "--train_batch_size", 16, "--micro_train_batch_size", 8, "--lmbda", 1.0,
        "--generate_max_len", 16, "--max_model_len", 128, *IMPOSSIBLE_KV,
        "--save_path", tmp_path / "out"], nproc=2)
    assert proc.returncode != 0, proc.stderr[-3000:]
    errors = error_lines(proc)
    print(f"{seconds:.1f} s: {errors}")
    assert len(errors) == 1 and errors[0].startswith("error: vLLM engine for "), errors
    assert "failed to start (KV cache 110000 MiB" in errors[0] and "ValueError: Available memory on node" in errors[0]
    assert seconds < 120, seconds
    assert_none_left(tag)
