#!/usr/bin/env bash
# The device check (docs/gpu.md): on one GPU with CUDA torch and transformers but no network, install the wheels
# that launch/fetch_gpu_wheels.sh fetched (WHEELS, default .whl/) into SITE (default /tmp/minrlhf_site) with pip
# --no-index --no-deps --target, then run tests/scripts/gpu_device_check.py with SITE first on the import path:
# one `PASS/FAIL <step> <figure> <bar> (<seconds> s)` line per step; OUT/steps/<step>.json, OUT/summary.json,
# OUT/device_check.log and all of them in OUT/device_check.tar.gz, inside 9 minutes.
# usage: launch/gpu_device_check.sh OUT [--rehearse] [--dry-run] [--steps a,b]
#   --rehearse: every step on CPU where it has a CPU meaning (CI); --dry-run: no install, imports only
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: launch/gpu_device_check.sh OUT [--rehearse] [--dry-run] [--steps a,b]}
shift
py=${PYTHON:-python3}
site=${SITE:-/tmp/minrlhf_site}
mkdir -p "$out"
if [[ " $* " != *" --dry-run "* ]]; then
  # --find-links: of the wheels fetched for several Pythons, pip takes the ones its own Python installs
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    --find-links "${WHEELS:-.whl}" -r launch/gpu_wheels.txt 2>&1 | tee -a "$out/device_check.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "FAIL install the wheels of ${WHEELS:-.whl} (launch/fetch_gpu_wheels.sh)" | tee -a "$out/device_check.log"
    exit 1
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} MINRLHF_SITE=$site
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 WANDB_MODE=offline
exec timeout 540 "$py" -m tests.scripts.gpu_device_check --out "$out" "$@"
