#!/usr/bin/env bash
# The GPU checks: build kvmove with KVMOVE_CUDA=1, run the GPU tests, print the GPU benchmarks
# (pack/unpack and the cuda_ipc transfer against cudaMemcpy device-to-device, and the
# layer-streaming hidden fraction behind a GPU prefill). Under 5 minutes on one H200.
#
# Needs nvcc, one GPU, and a Python environment (PYTHON, default python3) that has torch built
# for CUDA and kvmove's build requirements (pybind11, setuptools, libucx-cu13): the build runs
# without isolation, so it needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch here has no CUDA'"
echo "== build (KVMOVE_CUDA=1, archs ${KVMOVE_CUDA_ARCHS:-90})"
KVMOVE_CUDA=1 "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation --force-reinstall .

cd "$(mktemp -d)"  # import the installed kvmove, not the checkout's sources
"$PYTHON" -c "import kvmove; print(kvmove.cuda_status())"
echo "== GPU tests"
timeout 180 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider "$ROOT/tests/test_gpu.py"
echo "== GPU benchmarks"
timeout 120 "$PYTHON" "$ROOT/bench/gpu_bench.py" --iters 5
echo "== kvmove-bench transfer --memory cuda (device memory on both sides, every byte checked)"
timeout 120 "$PYTHON" -m kvmove.bench.cli transfer --memory cuda --tokens 2000 --iters 3 \
    --json > transfer-cuda.json
"$PYTHON" -c "import json; d = json.load(open('transfer-cuda.json')); \
print('transfer --memory cuda:', 'verified' if d['verified'] else 'WRONG BYTES', \
[(r['op'], round(r['gbytes_per_s'], 2)) for r in d['rows']], d['transports_used'])"
