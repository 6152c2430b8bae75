#!/usr/bin/env bash
# Set up (launch/setup.sh), lint (ruff.toml), and run the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ruff check algos common tests benchmarks
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q tests "$@"
