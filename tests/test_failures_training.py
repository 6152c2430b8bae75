"""Failure paths of the torchrun training scripts (through sft.py's real CLI): a launcher killed with
SIGKILL takes its workers with it, and a checkpoint directory has one writer at a time."""

import glob
import os
import socket
import subprocess
import sys
import time

import psutil
from conftest import ROOT, run_script

TASK = ["--input_key", "prompt", "--output_key", "response", "--apply_chat_template", "--max_len", "64"]


def sft_args(assets, tmp_path, *extra):
    return ["--pretrain", f"{assets}/llama-0.5m", "--dataset", f"{assets}/data/reverse/sft_train.jsonl", *TASK,
            "--save_path", tmp_path / "out", "--ckpt_path", tmp_path / "ckpt", *extra]


def test_killed_launcher_leaves_no_worker(assets, tmp_path):
    """SIGKILL the launcher of a 2-rank run mid-training: both workers are gone within 10 s."""
    metrics = tmp_path / "m.jsonl"
    # 64 samples, 8 per step, 200 epochs: 1,600 steps, far more than the test waits for
    args = sft_args(assets, tmp_path, "--max_samples", 64, "--train_batch_size", 8, "--micro_train_batch_size", 4,
                    "--max_epochs", 200, "--metrics_file", metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "algos", "sft.py"), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(tmp_path / "log.txt", "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        deadline = time.time() + 180
        while not (metrics.exists() and metrics.read_text().strip()):  # training has started
            assert launcher.poll() is None and time.time() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.2)
        workers = [p for p in psutil.Process(launcher.pid).children() if "algos/sft.py" in " ".join(p.cmdline())]
        assert len(workers) == 2
        launcher.kill()
        launcher.wait()
        killed_at = time.time()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers {[p.pid for p in alive]} outlived their launcher by 10 s"
        print(f"workers gone {time.time() - killed_at:.2f} s after the launcher was killed")
    finally:
        launcher.kill()
        for p in workers:  # only when the assertion above failed
            if p.is_running():
                p.kill()


def test_second_run_on_a_held_ckpt_path_fails_at_once(assets, tmp_path):
    """While a process holds --ckpt_path, a 2-rank run on it stops before loading data or model,
    naming the holder's pid and host, with one error line."""
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from common.infra.engine import CkptArgs, hold_ckpt_path; "
        "hold_ckpt_path(CkptArgs(ckpt_path=sys.argv[1], save_steps=1)); print('held', flush=True); time.sleep(600)"),
        str(ckpt)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        proc = run_script("sft.py", sft_args(assets, tmp_path, "--save_steps", 1), nproc=2, expect_ok=False)
        elapsed = time.time() - t0
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --ckpt_path {ckpt} is held by another run (pid {holder.pid} on host "
                      f"{socket.gethostname()}; lock file {ckpt}/run.lock): wait for it to end, stop it, or pick "
                      "another --ckpt_path"], proc.stderr
    output = proc.stdout + proc.stderr
    assert "Preparing" not in output and "Loading weights" not in output  # refused before data and model
    assert elapsed < 60, elapsed  # measured ~12 s, most of it torchrun and imports


def test_stale_lock_is_taken_over(assets, tmp_path):
    """A lock file left by a run that died (its pid is gone) does not block a resume; the run
    releases the lock at exit, and leaves no temporary `latest` file."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "run.lock").write_text(f"pid {dead.pid} on host {socket.gethostname()}\n")
    proc = run_script("sft.py", sft_args(assets, tmp_path, "--max_samples", 16, "--train_batch_size", 8,
                                         "--micro_train_batch_size", 8, "--save_steps", 1, "--load_checkpoint"))
    assert f"took over the lock of a run that is no longer running (pid {dead.pid} on host" in proc.stdout
    assert (ckpt / "latest").read_text() == "global_step2"
    assert (ckpt / "run.lock").read_text() == ""  # released
    assert not glob.glob(f"{ckpt}/latest.tmp*")
