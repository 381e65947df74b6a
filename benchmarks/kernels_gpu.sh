#!/usr/bin/env bash
# GPU kernel check in one device call: the @gpu kernel tests at real sizes, then the kernel benchmark.
# Usage (repo root, on the GPU machine): bash benchmarks/kernels_gpu.sh [OUT_DIR]
# Needs only torch, triton, transformers and pytest there; installs this repo editable, offline.
set -o pipefail
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1; then
    # Fallback: a package folder laid out as the wheel maps it (fxrewrite/kernels -> kernels/, ...).
    mkdir -p /tmp/fxpkg/fxrewrite && cp -r fxrewrite/. /tmp/fxpkg/fxrewrite/
    for d in kernels patterns runtime benchmarks; do ln -sfn "$PWD/$d" /tmp/fxpkg/fxrewrite/$d; done
    export PYTHONPATH=/tmp/fxpkg${PYTHONPATH:+:$PYTHONPATH}
    echo "editable install failed (see pip.log); using PYTHONPATH=/tmp/fxpkg"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/kernels 2>&1 | tee "$out/kernel_gpu_tests.log"
timeout 300 python3 -m fxrewrite.benchmarks.kernels --out "$out" 2>&1 | tee "$out/kernel_bench.log"
