"""A script copied out of the checkout (README: Forking a script) runs from any folder with the checkout on
PYTHONPATH, Ray workers included; without it, it stops with one error line that says so. grpo.py's copy (its Ray
workers importing common/) runs in tests/test_grpo.py's resume test, which resumes the learning run from a copy."""

import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, read_jsonl


def copy_and_run(tmp_path, script, args, pythonpath=ROOT, timeout=600):
    """algos/<script> copied to tmp_path/ideas/, run from tmp_path/work/: the completed process."""
    ideas, work = tmp_path / "ideas", tmp_path / "work"
    ideas.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "algos", script), ideas / script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"})
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, str(ideas / script), *map(str, args)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_ok(proc):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_copied_dpo_runs_two_steps_from_another_folder(assets, tmp_path):
    proc = copy_and_run(tmp_path, "dpo.py", ["--help"])
    check_ok(proc)
    assert "--beta" in proc.stdout
    proc = copy_and_run(tmp_path, "dpo.py", [
        "--pretrain", f"{assets}/llama-0.5m", "--dataset", f"{assets}/data/reverse/pref_train.jsonl",
        "--apply_chat_template", "--max_len", 64, "--max_samples", 16, "--train_batch_size", 8,
        "--micro_train_batch_size", 8, "--learning_rate", 3e-4, "--metrics_file", tmp_path / "metrics.jsonl"])
    check_ok(proc)
    losses = [m["train/loss"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(losses) == 2 and abs(losses[0] - math.log(2)) <= 1e-5 and abs(losses[1] - math.log(2)) > 1e-5
    assert (tmp_path / "work" / "outputs" / "dpo" / "config.json").exists()  # the default --save_path, under cwd


@pytest.mark.quick
def test_a_copy_without_the_checkout_on_pythonpath_says_how_to_point_at_it(tmp_path):
    proc = copy_and_run(tmp_path, "dpo.py", ["--help"], pythonpath=None)
    script = tmp_path / "ideas" / "dpo.py"
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {script} cannot import common/: run it with PYTHONPATH=<the minrlhf checkout>"]
