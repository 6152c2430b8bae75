"""The GPU check scripts on CPU: tests/scripts/gpu_device_check.py's dry run (the wheel list pins every package the
GPU image lacks, every step's modules import; the wheels themselves are not needed), and
tests/scripts/gpu_test_modules.py leaving out by name the test modules that need vllm or ray when those are absent,
so that launch/gpu_checks.sh still collects the others."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))


def test_device_check_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "gpu_device_check.py"), "--dry-run",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS dry_run wheels=13 steps=10" in proc.stdout
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
