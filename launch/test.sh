#!/usr/bin/env bash
# Set up (launch/setup.sh), lint (ruff.toml), and run the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
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
# the slowest tests are listed at the end, to keep the suite inside its time (README)
exec .venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadfile tests "$@"
