#!/usr/bin/env bash
# What tools/gpu_check.py needs on the device machine that it may lack, into build/gpu-carry/ (git-ignored;
# name it in the run tool's `carry`): compressed-tensors 0.19.0 (its Triton quantize kernel) and the wheels
# of its small dependencies, and ml_dtypes (fp8ref reads bfloat16 through it), for CPython 3.10-3.13 (the device's version is not known in advance).
# The device has torch, Triton and transformers already. Total about 10 MiB (the carry limit is 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=build/gpu-carry
rm -rf "$dest" && mkdir -p "$dest"
pip download -q --no-deps -d "$dest" compressed-tensors==0.19.0 loguru pydantic typing-inspection annotated-types
for py in 3.10 3.11 3.12 3.13; do
  pip download -q --no-deps --only-binary :all: --python-version "$py" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dest" pydantic-core psutil ml-dtypes
done
du -sh "$dest" && ls "$dest"
