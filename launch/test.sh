#!/usr/bin/env bash
# Set up (launch/setup.sh), lint (ruff.toml), and run the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ruff check algos common tests benchmarks
export TOKENIZERS_PARALLELISM=false
# DeepSpeed JIT-builds C++ ops (shm comm, CPU Adam) for this venv's torch: a cache of this checkout's
# own, so another checkout's venv never rebuilds them under a running job
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
# the slowest tests are listed at the end, to keep the suite inside its time (README)
exec .venv/bin/python -m pytest -q --durations=25 tests "$@"
