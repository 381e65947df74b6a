#!/usr/bin/env bash
# Batch-1 decode with the tagged one-token GEMV backends (the pipelined GEMV, and the prologue's own kernel before
# the plain skinny GEMV) against the skinny-only tuner of before, in one device call (<= ~9 min): the GPU tests
# of the new backends, then bench compare latency at max-num-seqs 1 (native,after) for each CONFIGS entry with
# FXREWRITE_GEMV_CANDIDATES=skinny and =all, every engine's tuner timings in $OUT/gemv-tune-<candidates>.jsonl.
# Usage (repo root, on the GPU machine): OUT=<dir> CONFIGS="qwen3-32b qwen3-4b" bash benchmarks/gemv_candidates_check.sh
# (ORDER="all" skips the skinny-only baseline; STEP_S caps each compare; BUDGET caps the whole script.)
set -o pipefail
source benchmarks/gpu_env.sh

stamp "GPU tests (pipelined GEMV, engine decode logits with the GEMV)"
# TESTS: other pytest arguments (e.g. the GPU tests of a change that rides along in the same call)
timeout -k 5 "$(left "${TESTS_S:-100}")" $PY -m pytest -q -rs -m gpu -p no:cacheprovider ${TESTS:-tests/gpu/test_gpu_skinny_gemv_pipelined.py \
  tests/gpu/test_gpu_skinny_gemv.py -k "pipelined or logits or engine_load"} 2>&1 | tee "$OUT_DIR/gemv-candidates-gpu-tests.log" | tail -8

for config in ${CONFIGS:-qwen3-32b qwen3-4b}; do
  for candidates in ${ORDER:-skinny all}; do
    stamp "bench compare $config latency, FXREWRITE_GEMV_CANDIDATES=$candidates"
    FXREWRITE_GEMV_CANDIDATES=$candidates FXREWRITE_GEMV_TUNE_LOG="$OUT_DIR/gemv-tune-$candidates.jsonl" \
      timeout -k 5 "$(left "${STEP_S:-110}")" $PY -m fxrewrite bench compare --config "$config" --arms native,after \
      --workload latency --max-num-seqs 1 --time-limit "${ARM_TIME_LIMIT:-8}" \
      --note "FXREWRITE_GEMV_CANDIDATES=$candidates" "${TOK[@]}" --out "$OUT_DIR/$candidates" 2>&1 \
      | grep -v "it/s\]$" | tail -6
  done
done
stamp "done"
