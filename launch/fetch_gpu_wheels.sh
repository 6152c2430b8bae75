#!/usr/bin/env bash
# Download the wheels of launch/gpu_wheels.txt into .whl/ (git-ignored) for Python 3.12 on x86-64 Linux, where PyPI
# is reachable, for launch/gpu_device_check.sh to install on a GPU machine without network (~20 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do platforms+=(--platform "$p"); done
grep -v '^#' launch/gpu_wheels.txt | grep . | while read -r pin; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pin"
done
ls .whl/*.whl | wc -l | xargs echo "wheels in .whl/:"
du -sh .whl
