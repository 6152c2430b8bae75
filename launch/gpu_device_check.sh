#!/usr/bin/env bash
# The device check (docs/gpu.md): on one GPU with CUDA torch and transformers but no network, install the wheels of
# launch/gpu_wheels.txt from .whl/ (launch/fetch_gpu_wheels.sh), then run tests/scripts/gpu_device_check.py: one
# `PASS/FAIL <step> <figure>` line per step, results as JSON in RESULTS_DIR, inside 8 minutes.
# usage: launch/gpu_device_check.sh RESULTS_DIR [--dry-run] [--steps a,b]   (--dry-run: no install, no GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: launch/gpu_device_check.sh RESULTS_DIR [--dry-run] [--steps a,b]}
shift
if [[ " $* " != *" --dry-run "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/minrlhf_site \
    .whl/*.whl || { echo "FAIL install the wheels of .whl/ (launch/fetch_gpu_wheels.sh)"; exit 1; }
  export PYTHONPATH=/tmp/minrlhf_site${PYTHONPATH:+:$PYTHONPATH}
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 WANDB_MODE=offline
exec timeout 480 python3 tests/scripts/gpu_device_check.py --out "$out" "$@"
