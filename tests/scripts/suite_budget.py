"""The test suite's time budget, scaled by two speed probes (launch/test.sh).

The compute probe is fp32 matmul GFLOP/s on one thread (the thread count of every script the tests launch) at a
fixed shape, the best of several repeats. The start-up probe is the seconds a fresh Python takes to import torch
and transformers' model classes, the best of three: every process a test launches pays that first, and machines
whose matmul rates differ by 2x start Python at much the same speed. The budget is REFERENCE_BUDGET_S on a machine
that reads REFERENCE_GFLOPS and REFERENCE_IMPORT_S, scaled up by the slower of the two ratios and never down.
Loaded as a pytest plugin (tests/conftest.py), it fails a session that ran past MINRLHF_SUITE_BUDGET_S with one
line naming the slowest tests. `python tests/scripts/suite_budget.py [--quick]` prints the probes and the budget.
"""

import os
import subprocess
import sys
import time
from collections import defaultdict

# the reference machine: matmul like the 2-core Intel Xeons (AVX-512) whose probe reads 157-177; Python start-up
# 1.25x faster than the machine of docs/testing.md's figure (3.9-4.35 s), so that one gets at least 1.25x
REFERENCE_GFLOPS = 160.0
REFERENCE_IMPORT_S = 3.2
REFERENCE_BUDGET_S = {"full": 2000.0, "quick": 240.0}
PROBE_SHAPE = 512
IMPORT_PROBE = "import torch, transformers; from transformers import AutoModelForCausalLM"
SLOWEST_NAMED = 5


def probe_gflops(repeats=15, matmuls=16):
    """fp32 matmul GFLOP/s on one thread at PROBE_SHAPE, the best of `repeats` timings of `matmuls` products."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(PROBE_SHAPE, PROBE_SHAPE, generator=g)
        b = torch.randn(PROBE_SHAPE, PROBE_SHAPE, generator=g)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(matmuls):
                a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * PROBE_SHAPE**3 * matmuls / best / 1e9


def probe_import_s(repeats=3):
    """Seconds a fresh Python takes to run IMPORT_PROBE, the best of `repeats` (the first also warms the file
    cache)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", IMPORT_PROBE], check=True, capture_output=True, timeout=300)
        best = min(best, time.perf_counter() - start)
    return best


def budget_s(gflops, tier="full", import_s=0.0):
    """The tier's budget on a machine whose probes read `gflops` and `import_s`: longer by the slower of the two
    ratios to the reference machine, never shorter."""
    return REFERENCE_BUDGET_S[tier] * max(1.0, REFERENCE_GFLOPS / gflops, import_s / REFERENCE_IMPORT_S)


def verdict(elapsed_s, budget, durations):
    """None within the budget; past it, one `error:` line with the time, the budget and the slowest tests
    (`durations`: {test id: seconds of setup, call and teardown})."""
    if elapsed_s <= budget:
        return None
    slowest = sorted(durations.items(), key=lambda item: -item[1])[:SLOWEST_NAMED]
    named = ", ".join(f"{test} {seconds:.0f} s" for test, seconds in slowest)
    return (f"error: the suite took {elapsed_s:.0f} s, past its budget of {budget:.0f} s "
            f"(MINRLHF_SUITE_BUDGET_S, docs/testing.md); slowest: {named}")


# pytest plugin: on the controlling process (xdist workers report to it), per test its setup, call and teardown
test_seconds = defaultdict(float)
session_start = []


def pytest_sessionstart(session):
    session_start.append(time.time())


def pytest_runtest_logreport(report):
    test_seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    budget = os.environ.get("MINRLHF_SUITE_BUDGET_S")
    if not budget or hasattr(session.config, "workerinput") or not session_start:
        return
    line = verdict(time.time() - session_start[0], float(budget), test_seconds)
    if line:
        print(f"\n{line}", file=sys.stderr)
        session.exitstatus = 1


if __name__ == "__main__":
    tier = "quick" if "--quick" in sys.argv else "full"
    gflops, import_s = probe_gflops(), probe_import_s()
    print(f"{gflops:.1f} {import_s:.2f} {budget_s(gflops, tier, import_s):.0f}")
