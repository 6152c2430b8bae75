"""The GPU check scripts on CPU: the device check's rehearsal end to end (the wheel set fetched from PyPI, installed
with the device's command into a clean target, the carried packages imported from there, every step on CPU, the
results as files and one archive), a step run alone, the dry run, and tests/scripts/gpu_test_modules.py leaving out
by name the test modules that need vllm or ray when those are absent, so that launch/gpu_checks.sh still collects
the others."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile


import pytest

from conftest import PYTHONPATH, ROOT



@pytest.mark.quick
def test_device_check_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.gpu_device_check", "--dry-run",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS dry_run wheels=13 steps=14" in proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text()) == {"dry_run": True}


@pytest.mark.quick
def test_wheel_list_is_pinned_and_complete():
    import gpu_device_check

    pins = gpu_device_check.read_wheel_list()
    assert gpu_device_check.NEEDED_WHEELS <= set(pins)
    assert pins["deepspeed"] == "0.19.8" and pins["ring-flash-attn"] == "0.1.8"
    lines = open(os.path.join(ROOT, "requirements.txt")).read().splitlines()
    requirements = {line.split("==")[0].lower(): line.split("==")[1].strip()
                    for line in lines if "==" in line and not line.startswith("#")}
    for name in ("deepspeed", "tyro", "datasets"):  # the CPU environment's pins
        assert pins[name] == requirements[name], name


@pytest.mark.quick
def test_gpu_checks_collect_without_vllm_ray_flash_attn():
    """With vllm, ray, flash_attn and ring_flash_attn absent, only the modules that import them at module level
    (directly or through the project modules and sibling tests they import) are left out."""
    import glob

    import gpu_test_modules

    files = sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    absent = {"vllm", "ray", "flash_attn", "ring_flash_attn"}
    left_out = {os.path.basename(f): m for f, m in gpu_test_modules.modules_left_out(files, lambda n: n not in absent)}
    assert left_out["test_vllm_engine.py"] == ["vllm"]
    assert "test_ppo.py" not in left_out  # Ray is imported inside common/infra/cluster.py's calls, not at import
    assert "test_gpu_paths.py" not in left_out and "test_packing.py" not in left_out
    assert len(left_out) < len(files) // 2
    everything = gpu_test_modules.modules_left_out(files, lambda n: True)
    assert everything == []


@pytest.mark.quick
def test_gpu_checks_fail_on_skips_and_fit_a_device_command():
    script = open(os.path.join(ROOT, "launch", "gpu_checks.sh")).read()
    assert "timeout 570" in script and "SKIPPED" in script and "gpu_test_modules.py" in script


@pytest.mark.quick
def test_gpu_requirements_have_what_gpu_checks_use():
    """gpu_checks.sh's pytest flags come from plugins that requirements-gpu.txt installs."""
    script = open(os.path.join(ROOT, "launch", "gpu_checks.sh")).read()
    names = {line.split("==")[0].strip().lower() for line in open(os.path.join(ROOT, "requirements-gpu.txt"))
             if "==" in line and not line.startswith("#")}
    assert "--timeout" in script and "pytest-timeout" in names


@pytest.mark.quick
def test_step_run_alone(tmp_path):
    """--steps packed_vs_padded alone loads its model by the name varlen_sdpa (registered by the step's own
    modules, not by an earlier step), and its result lands under --out: steps/<step>.json, summary.json, the log
    and all three in the archive."""
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.gpu_device_check", "--rehearse",
                           "--steps", "packed_vs_padded", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS packed_vs_padded" in proc.stdout
    step = json.loads((tmp_path / "steps" / "packed_vs_padded.json").read_text())
    assert step["status"] == "PASS" and step["logp_max_abs_diff"] <= 1e-4 and step["grad_rel_diff"] <= 1e-4
    assert json.loads((tmp_path / "summary.json").read_text())["packed_vs_padded"]["status"] == "PASS"
    with tarfile.open(tmp_path / "device_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"device_check/steps/packed_vs_padded.json", "device_check/summary.json",
            "device_check/device_check.log"} <= names


def fetched_wheels():
    """launch/fetch_gpu_wheels.sh's wheel set, fetched once per wheel list and fetch script (their hash names the
    folder under .venv/, which CI caches) and reused after."""
    digest = hashlib.sha256(b"".join(open(os.path.join(ROOT, "launch", f), "rb").read()
                                     for f in ("gpu_wheels.txt", "fetch_gpu_wheels.sh"))).hexdigest()[:16]
    folder = os.path.join(ROOT, ".venv", "gpu_wheels", digest)
    if not os.path.exists(os.path.join(folder, "complete")):
        part = folder + ".part"
        shutil.rmtree(part, ignore_errors=True)
        proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "fetch_gpu_wheels.sh"), part], cwd=ROOT,
                              capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(os.path.join(part, "complete"), "w") as f:
            f.write(proc.stdout)
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(part, folder)
    return folder


def test_device_check_rehearsal(tmp_path):
    """What the device runs, except CUDA: the wheel set (fetched, cached under .venv/) installed by
    launch/gpu_device_check.sh's own pip command into a clean target, a process with that target first on its
    import path importing every carried package from it, then every step in --rehearse, its results under OUT and
    in OUT's one archive."""
    import gpu_device_check

    wheels = fetched_wheels()
    total = sum(os.path.getsize(os.path.join(wheels, f)) for f in os.listdir(wheels) if f.endswith(".whl"))
    assert total < 32 * 2**20  # of the 64 MiB a device command carries, with room for the tree
    site, out = tmp_path / "site", tmp_path / "out"
    # the carried deepspeed JIT-builds its CPU ops (shm comm, ~50 s) from its own sources: in a folder of its own,
    # not the suite's, which the suite's deepspeed would then build again
    env = {**os.environ, "WHEELS": wheels, "SITE": str(site), "PYTHON": sys.executable,
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_device_check.sh"), str(out), "--rehearse"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    print(proc.stdout)
    code = "import json; import gpu_device_check; print(json.dumps(gpu_device_check.carried_files()))"
    path = os.pathsep.join([str(site), PYTHONPATH])  # the carried packages first, then the checkout
    where = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert where.returncode == 0, where.stderr[-3000:]
    files = json.loads(where.stdout.strip().splitlines()[-1])
    assert set(files) == set(gpu_device_check.CARRIED)
    for name, path in files.items():
        assert os.path.realpath(path).startswith(os.path.realpath(site)), (name, path)
    assert proc.returncode == 0, report
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == set(gpu_device_check.STEPS), report
    assert all(r["status"] == "PASS" for r in summary.values()), report
    env_step = json.loads((out / "steps" / "env.json").read_text())
    assert env_step["foreign"] == [] and set(env_step["files"]) == set(gpu_device_check.CARRIED)
    log = (out / "device_check.log").read_text()
    assert log.count("PROBE ") == 1 and "DONE passed=14 failed=0" in log
    for step in gpu_device_check.CUDA_ONLY:
        assert f"CUDA ONLY {step}: " in log
    with tarfile.open(out / "device_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"device_check/steps/{s}.json" for s in summary} | {"device_check/summary.json"} <= names
