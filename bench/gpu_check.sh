#!/usr/bin/env bash
# The GPU check, in one device call: the CUDA tests, then each of the trainer's GPU paths measured
# (bench/gpu_check.py: the chunked loss against liger-kernel's fused one, bf16 steps of SmolLM2-135M
# in each trainer layout, FSDP2 over NCCL on one rank, the trainer side of a weight update), every
# stage bounded and reported, the next one run whatever the last did; last line: RESULT ...
#
# It needs only the machine's image (torch with CUDA, transformers, peft, triton, aiohttp, ...)
# and the wheels bench/gpu_wheels.sh put in .whl/ (carried with the call: `carry: [".whl"]`):
#
#   bench/gpu_check.sh
#
# On a machine without CUDA it exits at once with status 2, saying so.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device on this machine ($(uname -n)); nothing to check" >&2
    exit 2
fi
echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
"$PY" -c 'import sys, torch; print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")'

SITE="${ROLLFLOW_GPU_SITE:-/tmp/rollflow-site}"
if compgen -G ".whl/*.whl" >/dev/null; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
        echo "gpu_check: installing the carried wheels failed; stages that need them will say so" >&2
    fi
else
    echo "gpu_check: no wheels in .whl/ (run bench/gpu_wheels.sh here first); stages that need them will say so" >&2
fi
export PYTHONPATH="$PWD/src:$PWD/bench:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py
