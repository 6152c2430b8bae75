#!/usr/bin/env bash
# The GPU-only checks (flash-attention packing, bf16, CUDA-IPC weight sync into vLLM), a few minutes on one GPU, in an
# environment installed from requirements-gpu.txt (see README). Builds the tiny assets first.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m common.tiny --out assets >/dev/null 2>&1
export TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -m gpu tests -rs "$@"
