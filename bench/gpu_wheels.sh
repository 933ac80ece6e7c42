#!/usr/bin/env bash
# The wheels the GPU check needs beyond the lent machine's image (bench/gpu_image.txt lists what it
# has), for its Python 3.12 on x86-64, downloaded here into .whl/ (git-ignored) to be carried with
# the device call. tests/unit/test_gpu_check.py checks that the image and these together hold every
# package the check imports.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS=(
    "msgspec==0.23.0"       # rollflow's records and config
    "liger-kernel==0.8.5"   # the fused linear cross entropy the check compares with the chunked loss
    "pytest-asyncio==1.5.0" # the suite's pytest configuration names its options (tests/gpu)
)
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -l .whl
