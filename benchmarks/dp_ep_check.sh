#!/usr/bin/env bash
# Issue 13 (data parallel + expert parallel) on nvidia-h200-x2; one call per MODE (each under 10 min):
#   MODE=test: tests/gpu/test_gpu_data_parallel.py: greedy tokens (float32) of a 2-layer model with
#              Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048), DP2+EP2 and TP=2 against TP=1.
#   MODE=dp:   Qwen3-30B-A3B (48 layers, dummy bf16 weights) throughput, after and native arms, DP2+EP2.
#   MODE=tp:   the same at TP=2 (the comparison issue 13 asks for).
#   MODE=graphs: MODE=test's greedy tests (DP2+EP2 decode waves now in CUDA graphs, reduce-scatter combine),
#              then MODE=dp's throughput with a shorter time limit (one call of the device tool, < 10 min).
# Results (JSON, logs) go to $OUT when set, else benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench() { timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 | grep -v "it/s\]$" | tail -8; }
case "${MODE:-test}" in
  test) timeout -k 5 500 $PY -m pytest -q -m gpu tests/gpu/test_gpu_data_parallel.py -p no:cacheprovider -rfE 2>&1 \
          | tee "$OUT_DIR/dp-ep-tests.log" | tail -6 ;;
  dp) bench 540 --config qwen3-30b-a3b --arms after,native --num-prompts 256 --time-limit 60 -dp 2 --enable-expert-parallel ;;
  graphs) timeout -k 5 220 $PY -m pytest -q -m gpu tests/gpu/test_gpu_data_parallel.py -p no:cacheprovider -rfE 2>&1 \
          | tee "$OUT_DIR/dp-ep-tests.log" | tail -6
        bench 300 --config qwen3-30b-a3b --arms after,native --num-prompts 256 --time-limit 35 -dp 2 --enable-expert-parallel ;;
  tp) bench 540 --config qwen3-30b-a3b --arms after,native --num-prompts 256 --time-limit 60 -tp 2 ;;
  *) echo "MODE must be test, dp, tp or graphs"; exit 2 ;;
esac
