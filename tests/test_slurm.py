"""launch/torchrun.sbatch and launch/ray.sbatch under a real Slurm: a one-node cluster (munge, slurmctld,
slurmd) started by launch/local_slurm.sh as root. Each template trains a tiny model through `sbatch --wait`
with exit code 0, and a broken flag fails its job quickly, the Ray cluster torn down.

Needs Debian's slurm-wlm and munge, and root; .ci/run installs them and sets MINRLHF_REQUIRE_SLURM=1, so in
CI these tests fail rather than skip when Slurm is missing."""

import os
import re
import shutil
import socket
import subprocess
import time

import pytest
from conftest import ROOT, max_weight_diff, read_jsonl

pytestmark = pytest.mark.slurm
MISSING = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(b, path=os.environ["PATH"] +
                                                                                  ":/usr/sbin")]
# overrides of the templates' #SBATCH lines for this machine: one node, no GPUs, a few logical CPUs
ONE_NODE = ["--nodes", "1", "--gpus-per-node", "0"]
REVERSE = f"{ROOT}/assets/data/reverse"


def two_free_ports():
    """A port p with p + 1 also free (slurmctld's and slurmd's), so another local Slurm here does not collide."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            try:
                b.bind(("", a.getsockname()[1] + 1))
            except OSError:
                continue
            return a.getsockname()[1]
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = (f"Slurm not installed ({', '.join(MISSING)} missing: apt-get install -y slurm-wlm munge)" if MISSING
           else "the local Slurm needs root" if os.geteuid() != 0 else None)
    if why:
        if os.environ.get("MINRLHF_REQUIRE_SLURM"):
            pytest.fail(f"{why}, and MINRLHF_REQUIRE_SLURM is set")
        pytest.skip(why)
    state = tmp_path_factory.mktemp("slurm")
    script = os.path.join(ROOT, "launch", "local_slurm.sh")
    subprocess.run(["bash", script, "start", state], check=True, timeout=120,
                   env={**os.environ, "LOCAL_SLURM_PORT": str(two_free_ports())})
    env = {**os.environ, "SLURM_CONF": f"{state}/slurm.conf", "PATH": os.environ["PATH"] + ":/usr/sbin",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", f"{ROOT}/.venv/torch_extensions"),
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1"}  # as conftest.run_script: spinning OpenMP threads crawl on shared cores
    yield env
    subprocess.run(["bash", script, "stop", state], timeout=60)


def sbatch(env, cwd, template, script, args, cpus, timeout=600):
    """`sbatch --wait` a template from `cwd`; returns (exit code, job log text, job id, seconds)."""
    start = time.time()
    proc = subprocess.run(["sbatch", "--wait", "--parsable", *ONE_NODE, "--cpus-per-task", str(cpus),
                           f"{ROOT}/launch/{template}", f"{ROOT}/algos/{script}", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.time() - start
    job = proc.stdout.split()[0].split(";")[0] if proc.stdout.strip() else None
    assert job and job.isdigit(), (proc.stdout, proc.stderr)
    name = "minrlhf-ray" if template == "ray.sbatch" else "minrlhf"
    log = cwd / f"{name}-{job}.out"  # the template's --output: one log per job in the submit directory
    return proc.returncode, log.read_text(errors="replace") if log.exists() else "", job, seconds


def ray_processes(job):
    """Processes still running from the job's Ray temp dir."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"/tmp/ray-{job}/" in line]


@pytest.fixture(scope="module")
def sft_job(slurm, tmp_path_factory):
    """algos/sft.py through launch/torchrun.sbatch: one epoch of reversal (the RL start model of conftest)."""
    tmp = tmp_path_factory.mktemp("sft_job")
    rc, log, job, seconds = sbatch(slurm, tmp, "torchrun.sbatch", "sft.py", [
        "--pretrain", f"{ROOT}/assets/llama-0.5m", "--dataset", f"{REVERSE}/sft_train.jsonl", "--input_key", "prompt",
        "--output_key", "response", "--apply_chat_template", "--max_len", 64, "--train_batch_size", 16,
        "--micro_train_batch_size", 16, "--learning_rate", 3e-3, "--save_path", tmp / "model",
        "--metrics_file", tmp / "metrics.jsonl"], cpus=2)
    assert rc == 0, log[-5000:]
    return tmp, log, job, seconds


def test_torchrun_template_trains(sft_job):
    tmp, log, job, seconds = sft_job
    assert f"torchrun.sbatch: job {job}, 1 nodes" in log and "x 1 ranks" in log
    losses = [m["train/loss"] for m in read_jsonl(tmp / "metrics.jsonl") if "train/loss" in m]
    assert len(losses) == 125  # 2000 samples / 16
    assert losses[0] > 5.0 and sum(losses[-10:]) / 10 < 1.5, (losses[0], losses[-10:])
    assert max_weight_diff(f"{ROOT}/assets/llama-0.5m", tmp / "model") > 0.01  # a trained model, saved
    print(f"torchrun.sbatch sft job: {seconds:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def test_ray_template_trains(slurm, sft_job, tmp_path):
    start_model = sft_job[0] / "model"
    rc, log, job, seconds = sbatch(slurm, tmp_path, "ray.sbatch", "grpo.py", [
        "--pretrain", start_model, "--prompt_data", f"{REVERSE}/rl_train.jsonl", "--input_key", "prompt",
        "--label_key", "answer", "--apply_chat_template", "--remote_rm_url", f"{ROOT}/launch/rewards/exact_match.py",
        "--n_samples_per_prompt", 4, "--rollout_batch_size", 8, "--train_batch_size", 32,
        "--micro_train_batch_size", 16, "--micro_rollout_batch_size", 16, "--actor_num_gpus_per_node", 1,
        "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len", 128, "--max_steps", 2,
        "--actor_learning_rate", 1e-4, "--save_path", tmp_path / "model", "--metrics_file", tmp_path / "metrics.jsonl",
    ], cpus=4)
    assert rc == 0, log[-5000:]
    assert "ray.sbatch: cluster ready: {'nodes': 1, 'CPU': 4.0, 'GPU': 0}" in log
    assert "Ray cluster stopped; exit code 0" in log
    steps = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "train/reward" in m]
    assert len(steps) == 2 and all(0 < m["train/reward"] < 1 for m in steps), steps  # groups that carry a signal
    assert all(m["rollout/logp_abs_diff_max"] <= 1e-4 for m in steps)
    assert max_weight_diff(start_model, tmp_path / "model") > 0  # the policy moved and was saved
    assert not ray_processes(job)  # the cluster is gone with the job
    print(f"ray.sbatch grpo job: {seconds:.0f} s, rewards {[round(m['train/reward'], 3) for m in steps]}")


@pytest.mark.parametrize("template,script,cpus", [("torchrun.sbatch", "sft.py", 2), ("ray.sbatch", "grpo.py", 4)])
def test_broken_flag_fails_the_job_quickly(slurm, tmp_path, template, script, cpus):
    rc, log, job, seconds = sbatch(slurm, tmp_path, template, script, [
        "--pretrain", f"{ROOT}/assets/llama-0.5m", "--no_such_flag", 1], cpus=cpus, timeout=180)
    assert rc != 0 and re.search(r"no_such_flag", log), log[-3000:]
    assert seconds < 120, seconds  # measured 12 s (torchrun) and 14 s (ray: the cluster starts first)
    if template == "ray.sbatch":
        assert re.search(r"Ray cluster stopped; exit code [1-9]", log), log[-3000:]
        assert not ray_processes(job)
    print(f"{template} broken flag: exit {rc} after {seconds:.0f} s")
