#!/usr/bin/env bash
# Set up (launch/setup.sh), lint (ruff.toml), and run the whole test suite on the CPU. Extra arguments go to pytest.
# --quick (first argument) runs the quick tier instead: the tests marked `quick` (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=full
if [ "${1:-}" = "--quick" ]; then
  tier=quick
  shift
fi
bash launch/setup.sh
.venv/bin/ruff check algos common tests benchmarks launch
export TOKENIZERS_PARALLELISM=false
# DeepSpeed JIT-builds C++ ops (shm comm, CPU Adam) for this venv's torch: a cache of this checkout's
# own, so another checkout's venv never rebuilds them under a running job
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
# Test files run on parallel workers (whole files: a module's fixtures stay on one worker): most tests
# keep a core busy at a time, so one worker left half of a 2-core machine idle. One worker per core the
# process may use, as many as the memory holds at ~6 GiB each (a test's peak: trainer ranks, vLLM engines,
# Ray), at least one; MINRLHF_TEST_WORKERS overrides. OpenMP threads sleep instead of spin-waiting
# when they wait, so one test's idle threads do not take the cores another test computes on.
workers=${MINRLHF_TEST_WORKERS:-$(.venv/bin/python -c '
import os
cores = len(os.sched_getaffinity(0))
available_kib = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable")))
print(max(1, min(cores, available_kib // (6 * 2**20))))')}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# The speed probes scale the tier's budget to this machine (tests/scripts/suite_budget.py); a whole tier run past
# it fails, naming its slowest tests. A run narrowed by extra arguments has no budget.
read -r gflops import_s budget < <(.venv/bin/python tests/scripts/suite_budget.py --$tier)
echo "speed probes: $gflops GFLOP/s (fp32 matmul, one thread), $import_s s to import torch and transformers;" \
  "$tier tier budget ${budget} s"
if [ $# -eq 0 ]; then
  export MINRLHF_SUITE_BUDGET_S=$budget
fi
marker=()
[ "$tier" = quick ] && marker=(-m quick)
start=$SECONDS
status=0
.venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadfile "${marker[@]}" tests "$@" || status=$?
echo "$tier tier: $((SECONDS - start)) s of pytest"
exit $status
