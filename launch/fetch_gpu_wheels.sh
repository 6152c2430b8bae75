#!/usr/bin/env bash
# Fetch the wheels of launch/gpu_wheels.txt into DIR (default .whl/, git-ignored) where PyPI is reachable, for
# launch/gpu_device_check.sh to install on a GPU machine without network: binary wheels for CPython 3.11 and 3.12
# on x86-64 Linux (the install picks its own Python's), and a wheel built here (`pip wheel --no-deps`) for a
# package published as a source distribution alone (deepspeed). Prints each wheel and the total size, which must
# fit the 64 MiB that travel with a device command.
# usage: launch/fetch_gpu_wheels.sh [DIR]        (PYTHON: the interpreter whose pip runs, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do platforms+=(--platform "$p"); done
sed 's/#.*//' launch/gpu_wheels.txt | grep . | while read -r pin; do
  binary=0
  for version in 3.11 3.12; do
    if "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
         "${platforms[@]}" -d "$dir" "$pin" 2>/dev/null; then binary=1; fi
  done
  if [ "$binary" -eq 0 ]; then  # no binary wheel on PyPI: build one (deepspeed: pure Python without its ops)
    DS_BUILD_OPS=0 "$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dir" "$pin" \
      || { echo "error: $pin: neither a binary wheel nor a wheel build (launch/gpu_wheels.txt)" >&2; exit 1; }
  fi
done
ls -l "$dir"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF; total += $5}
  END {printf "%8.2f MiB  %d wheels in total (64 MiB travel with a device command)\n", total / 1048576, NR}'
