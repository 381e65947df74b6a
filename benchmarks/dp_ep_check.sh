#!/usr/bin/env bash
# Issue 13 (data parallel + expert parallel) on nvidia-h200-x2, in one call:
#   1. tests/gpu/test_gpu_data_parallel.py: greedy tokens (float32) of a 2-layer model with Qwen3-30B-A3B's
#      shapes (128 experts, top-8, hidden 2048): DP2+EP2 and TP=2 against TP=1.          ~4 min
#   2. Qwen3-30B-A3B (all 48 layers, dummy bf16 weights) throughput, after and native arms, at
#      DP2+EP2 and at TP=2 (the comparison issue 13 asks for).                          ~2 x 3 min
# Results (JSON, logs) go to $OUT when set, else benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench() { timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 | grep -v "it/s\]$" | tail -8; }
timeout -k 5 280 $PY -m pytest -q -m gpu tests/gpu/test_gpu_data_parallel.py -p no:cacheprovider -rfE 2>&1 \
  | tee "$OUT_DIR/dp-ep-tests.log" | tail -6
bench 200 --config qwen3-30b-a3b --arms after,native --num-prompts 256 --time-limit 40 -dp 2 --enable-expert-parallel
bench 200 --config qwen3-30b-a3b --arms after,native --num-prompts 256 --time-limit 40 -tp 2
