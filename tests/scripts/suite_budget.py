"""The test suite's time budget, scaled by a speed probe (launch/test.sh).

The probe is fp32 matmul GFLOP/s on one thread (the thread count of every script the tests launch) at a fixed
shape, the best of several repeats. The budget is REFERENCE_BUDGET_S on a machine whose probe reads
REFERENCE_GFLOPS, scaled up on a slower machine and never down on a faster one. Loaded as a pytest plugin
(tests/conftest.py), it fails a session that ran past MINRLHF_SUITE_BUDGET_S with one line naming the slowest
tests. `python tests/scripts/suite_budget.py [--quick]` prints the probe and the budget it gives.
"""

import os
import sys
import time
from collections import defaultdict

# the machine docs/testing.md measures the suite on (2-core Intel Xeon with AVX-512: its probe reads 157-177)
REFERENCE_GFLOPS = 160.0
REFERENCE_BUDGET_S = {"full": 2000.0, "quick": 240.0}
PROBE_SHAPE = 512
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


def budget_s(gflops, tier="full"):
    """The tier's budget on a machine whose probe reads `gflops`: longer on a slower machine, never shorter."""
    return REFERENCE_BUDGET_S[tier] * max(1.0, REFERENCE_GFLOPS / gflops)


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
    gflops = probe_gflops()
    print(f"{gflops:.1f} {budget_s(gflops, tier):.0f}")
