#!/usr/bin/env bash
# The sixth session's last device call (nvidia-h200), steps in priority order under one 560 s budget,
# each step's results tarred into $R (the device tool's $OUT) as soon as it ends, so a cut run keeps them:
#   1. structured-output overhead at batch 64 (none / worker-thread grammar / main-thread grammar);
#   2. training arms liger, optimize (Qwen3-0.6B shapes, 8 x 2048, gradient checkpointing);
#   3. FP8 per-channel scaled_mm_rowwise GPU tests, Qwen3-4B throughput FP8 then bf16.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${OUT:?}; export OUT=/tmp/final; rm -rf "$OUT"; mkdir -p "$OUT"/{structured,train,fp8}
source benchmarks/gpu_env.sh
left() { local c=$1 l=$((560 - $(date +%s) + start)); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 10 ] && c=10; echo "$c"; }
pack() { tar czf "$R/$1.tgz" -C "$OUT/$1" .; }
timeout -k 5 "$(left 200)" $PY -m fxrewrite.benchmarks.structured_outputs --repeats 2 "${TOK[@]}" --out "$OUT/structured" \
  2>&1 | grep -v "tok/s\]" | tail -25; pack structured
timeout -k 5 "$(left 170)" $PY -m fxrewrite bench train --config qwen3-0.6b --arms liger,optimize --batch-size 8 --seq-len 2048 \
  --steps 5 --warmup 2 --arm-timeout 80 --out "$OUT/train" 2>&1 | tail -6; pack train
export FXREWRITE_FP8_TUNE_LOG="$OUT/fp8/fp8-tune.jsonl"
timeout -k 5 "$(left 50)" $PY -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider -rfE -k rowwise 2>&1 \
  | tee "$OUT/fp8/fp8-rowwise-tests.log" | grep -E "passed|failed|FAIL|Error" | tail -5
for q in "--quantization fp8" ""; do
  timeout -k 5 "$(left 70)" $PY -m fxrewrite bench compare --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 $q \
    "${TOK[@]}" --out "$OUT/fp8" 2>&1 | grep -v "it/s\]$" | tail -3
done; pack fp8
echo "final check done in $(($(date +%s) - start)) s"
