"""tests/scripts/suite_budget.py: the budget scales with the speed probe, and a session past it fails with one line
naming its slowest tests (a pytest session of its own, with a budget far below what it takes)."""

import os
import subprocess
import sys

import pytest
import suite_budget
from conftest import ROOT

pytestmark = pytest.mark.quick


def test_budget_grows_on_slower_machines_only():
    """By the slower of the two probes' ratios to the reference machine: a fast matmul does not shorten the budget
    of a machine that starts Python slowly."""
    reference, full = suite_budget.REFERENCE_GFLOPS, suite_budget.REFERENCE_BUDGET_S["full"]
    start_up = suite_budget.REFERENCE_IMPORT_S
    assert suite_budget.budget_s(reference) == full
    assert suite_budget.budget_s(reference / 2) == 2 * full
    assert suite_budget.budget_s(reference * 3) == full
    assert suite_budget.budget_s(reference / 4, "quick") == 4 * suite_budget.REFERENCE_BUDGET_S["quick"]
    assert suite_budget.budget_s(reference * 2, import_s=start_up * 1.5) == pytest.approx(1.5 * full)
    assert suite_budget.budget_s(reference / 2, import_s=start_up * 1.5) == 2 * full
    assert suite_budget.budget_s(reference, import_s=start_up / 2) == full
    gflops = suite_budget.probe_gflops(repeats=2, matmuls=2)
    assert 1.0 < gflops < 10_000.0
    assert 0.1 < suite_budget.probe_import_s(repeats=1) < 120.0


def test_verdict_names_the_slowest_tests():
    durations = {f"tests/test_x.py::t{i}": float(i) for i in range(10)}
    assert suite_budget.verdict(100.0, 100.0, durations) is None
    line = suite_budget.verdict(130.4, 100.0, durations)
    assert line == ("error: the suite took 130 s, past its budget of 100 s (MINRLHF_SUITE_BUDGET_S, "
                    "docs/testing.md); slowest: tests/test_x.py::t9 9 s, tests/test_x.py::t8 8 s, "
                    "tests/test_x.py::t7 7 s, tests/test_x.py::t6 6 s, tests/test_x.py::t5 5 s")


def test_a_session_past_its_budget_fails_naming_its_slowest_test(tmp_path):
    (tmp_path / "test_timed.py").write_text("import time\n\ndef test_fast():\n    pass\n\n"
                                            "def test_slow():\n    time.sleep(1.0)\n")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests", "scripts")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "suite_budget", "-p", "no:cacheprovider", "test_timed.py"]
    within = subprocess.run(command, cwd=tmp_path, env={**env, "MINRLHF_SUITE_BUDGET_S": "60"}, capture_output=True,
                            text=True, timeout=120)
    assert within.returncode == 0 and "error:" not in within.stderr, within.stdout + within.stderr
    past = subprocess.run(command, cwd=tmp_path, env={**env, "MINRLHF_SUITE_BUDGET_S": "0.5"}, capture_output=True,
                          text=True, timeout=120)
    errors = [line for line in past.stderr.splitlines() if line.startswith("error:")]
    assert past.returncode == 1 and len(errors) == 1, past.stdout + past.stderr
    assert "past its budget of 0 s" in errors[0]
    assert errors[0].split("slowest: ")[1].startswith("test_timed.py::test_slow 1 s")
