#!/usr/bin/env bash
# Skinny GEMV on the GPU in one device call: the sweep at Qwen3-4B / 32B shapes (JSON), then its GPU tests.
# Usage (repo root, on the GPU machine): OUT=<dir> bash benchmarks/gemv_gpu.sh   (default OUT benchmarks/results)
set -o pipefail
source benchmarks/gpu_env.sh
timeout -k 5 150 $PY -m fxrewrite.benchmarks.gemv --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gemv-bench.log" | tail -45
timeout -k 5 300 $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu/test_gpu_skinny_gemv.py 2>&1 \
  | tee "$OUT_DIR/gemv-gpu-tests.log" | tail -15
echo "gemv_gpu.sh: $(( $(date +%s) - start )) s"
