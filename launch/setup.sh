#!/usr/bin/env bash
# Create .venv in the checkout with the CPU requirements (idempotent: reinstalls only when
# requirements.txt changes), then build the tiny offline assets into assets/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  # PyPI's torchvision / torchaudio / torchcodec fail against the CPU torch ("operator
  # torchvision::nms does not exist") and break transformers' model imports; triton is GPU-only.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  echo "$want" > "$stamp"
fi
.venv/bin/python -m launch.tiny --out assets >/dev/null 2>&1
echo "setup done: .venv ($(.venv/bin/python -c 'import torch, deepspeed, vllm; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "vllm", vllm.__version__)' 2>/dev/null | tail -n 1)), assets/"
