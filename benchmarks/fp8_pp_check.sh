#!/usr/bin/env bash
# Issue 19 on the GPU machine, in one call (after gpu_check.sh's install step, which this repeats):
#   MODE=fp8     (nvidia-h200):    FP8 GPU tests; GEMM benchmark (bf16 cuBLAS vs Triton old/new/alt
#                                  tiles vs torch scaled_mm block/per-row; -fp8-gemm.json). ~8 min
#   MODE=fp8-4b  (nvidia-h200):    Qwen3-4B throughput and batch-8 latency, FP8 and bf16.  ~7 min
#   MODE=fp8-32b (nvidia-h200):    Qwen3-32B batch-1/8 decode, FP8 and bf16 (native arm). ~5 min
#   MODE=pp      (nvidia-h200-x2): PP=2 GPU test; Qwen3-32B throughput at PP=2 and TP=2.  ~8 min
#   MODE=fp8-fix (nvidia-h200):    <= 9 min in all: the tuner / CUDA-graph GPU tests (fp8-fix-tests.log);
#                                  every backend at M = 1, 8, 64, 256 on the Qwen3-32B shapes, graph-timed
#                                  (us, GB/s; -fp8-gemm.json); Qwen3-32B latency FP8 then bf16; Qwen3-4B
#                                  throughput FP8 then bf16 (bench JSONs). Each step is capped by its own
#                                  limit and by what is left of 540 s, so a slow step shortens the later ones.
#   MODE=fp8-rowwise (nvidia-h200): <= 9 min: Qwen3-4B throughput FP8 (per-channel online quantization, tuner
#                                  log in fp8-tune.jsonl) then bf16 (bench JSONs); decode-step profiles at batch
#                                  200, context 560, FP8 then bf16 (PROFILES=...; -decode-profile.json); with
#                                  TESTS=1 (default) the row-wise and fused-quantization GPU tests
#                                  (fp8-rowwise-tests.log) and the fused-quantization benchmark (-fp8-quant.json);
#                                  with TOKENS=64,256 the GEMM benchmark at Qwen3-4B shapes (-fp8-gemm.json).
#   MODE=fp8-gemv (nvidia-h200):   <= 7 min: the FP8 skinny GEMV and fused-quantization round. Triton kernels
#                                  built first in 16 processes (the engines' load-time tuners then hit the disk
#                                  cache); Qwen3-32B batch-1 latency FP8 then bf16 (max_num_seqs 1; tuner logs
#                                  fp8-tune.jsonl, gemv-tune.jsonl); Qwen3-4B throughput FP8 then bf16; the FP8
#                                  GPU tests (fp8-gemv-tests.log); the GEMV microbenchmark at 32B and 4B shapes,
#                                  FP8 per-channel / block and bf16 weights, M = 1 (-gemv-...-fp8...json);
#                                  the fused norm/SiLU + FP8 quantization microbenchmark (-fp8-quant.json).
#   MODE=fp8-pipelined (nvidia-h200): <= 9 min: the pipelined one-token FP8 GEMV's GPU tests (fp8-pipelined-tests.log);
#                                  batch-1 decode: Qwen3-32B FP8 then bf16, Qwen3-4B FP8 (bench JSONs; tuner logs).
#                                  MORE_TESTS=files and KEYS=(-k expression) add tests; RUNS="32b-fp8 4b ..." picks the decode runs.
#   MODE=kv-fp8 (nvidia-h200):     <= 9 min: FP8 KV-cache GPU tests (kv-fp8-tests.log); paged decode over bf16 vs
#                                  e4m3 caches (-kv-cache-fp8.json; KERNEL=0 skips it); Qwen3-4B throughput bf16 + FP8 KV, bf16, then
#                                  FP8 weights + FP8 KV (bench JSONs, -kvfp8 in the name); with PROFILES="none fp8"
#                                  decode-step profiles at batch 200, context 560 with the FP8 KV cache.
#   MODE=fp8-block (nvidia-h200):  <= 9 min: the pipelined GEMV's GPU tests with shared block scales (fp8-block-tests.log);
#                                  FP8 GEMM benchmark at one token, Qwen3-32B and Qwen3-4B (gemm/); RUNS (default
#                                  "32b-block 32b") in folders of their names: 32b-block = Qwen3-32B batch-1 decode on
#                                  128 x 128 block-scaled dummy weights (--hf-overrides quantization_config, as an FP8
#                                  checkpoint); 32b = bf16; 4b-block / 4b-fp8kv (throughput, --quantization fp8
#                                  --kv-cache-dtype fp8) / 4b (bf16 throughput) / 4b-latency (batch 1, native and after)
#                                  / 4b-profile (profile_decode, native, batch 1). GEMM=0 skips the GEMM benchmark.
# Results (JSON, logs) go to $OUT when set, else benchmarks/results. Each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench() { timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 \
  | tee -a "$OUT_DIR/bench.log" | grep -v "it/s\]$" | grep -Ev "^(INFO|DEBUG)" | tail -8; }
left() { local c=$1 l=$((540 - $(date +%s) + start)); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 10 ] && c=10; echo "$c"; }
if [ "${MODE:-fp8}" = fp8-gemv ]; then
  export FXREWRITE_FP8_TUNE_LOG="$OUT_DIR/fp8-tune.jsonl" FXREWRITE_GEMV_TUNE_LOG="$OUT_DIR/gemv-tune.jsonl"
  lim() { local c=$1 l=$((410 - $(date +%s) + start)); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 5 ] && c=5; echo "$c"; }
  timeout -k 5 "$(lim 70)" $PY -m fxrewrite.benchmarks.gemv --configs qwen3-32b,qwen3-4b --formats float,fp8,fp8-channel \
    --tokens 1,2,4,8 --precompile-only 2>&1 | tail -2
  bench "$(lim 100)" --config qwen3-32b --arms native --workload latency --max-num-seqs 1 --time-limit 10 --quantization fp8
  bench "$(lim 70)" --config qwen3-32b --arms native --workload latency --max-num-seqs 1 --time-limit 10
  bench "$(lim 60)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 --quantization fp8
  bench "$(lim 50)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15
  timeout -k 5 "$(lim 100)" $PY -m pytest -q -m gpu tests/gpu/test_gpu_skinny_gemv_fp8.py tests/gpu/test_gpu_fp8_quant.py \
    tests/gpu/test_gpu_fp8.py -p no:cacheprovider -rfE -s -k "skinny or quant or greedy or captures or rowwise" 2>&1 \
    | tee "$OUT_DIR/fp8-gemv-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -15
  timeout -k 5 "$(lim 20)" $PY -m fxrewrite.benchmarks.fp8_quant --out "$OUT_DIR" 2>&1 | tail -3
  timeout -k 5 "$(lim 90)" $PY -m fxrewrite.benchmarks.gemv --configs qwen3-32b,qwen3-4b --formats fp8-channel,fp8,float \
    --tokens 1 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/fp8-gemv-bench.log" | grep -E "M=1|wrote" | tail -30
  echo "fp8-gemv done in $(($(date +%s) - start)) s"
elif [ "${MODE:-fp8}" = fp8-fix ]; then
  export FXREWRITE_FP8_TUNE_LOG="$OUT_DIR/fp8-tune.jsonl"  # every load-time tuning: choices, us per backend
  timeout -k 5 "$(left 110)" $PY -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider -rfE -s \
    -k "tuned or captures or every_triton" 2>&1 | tee "$OUT_DIR/fp8-fix-tests.log" \
    | grep -E "passed|failed|FAIL|Error|assert" | tail -15
  timeout -k 5 "$(left 80)" $PY -m fxrewrite.benchmarks.fp8_gemm --models qwen3-32b --tokens 1,8,64,256 \
    --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/fp8-fix-gemm.log" | grep -v "it/s\]$" | tail -45
  bench "$(left 140)" --config qwen3-32b --arms native --workload latency --max-num-seqs 8 --time-limit 15 --quantization fp8
  bench "$(left 90)" --config qwen3-32b --arms native --workload latency --max-num-seqs 8 --time-limit 15
  bench "$(left 60)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 --quantization fp8
  bench "$(left 50)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15
  echo "fp8-fix done in $(($(date +%s) - start)) s"
elif [ "${MODE:-fp8}" = fp8-pipelined ]; then
  export FXREWRITE_FP8_TUNE_LOG="$OUT_DIR/fp8-tune.jsonl" FXREWRITE_GEMV_TUNE_LOG="$OUT_DIR/gemv-tune.jsonl"
  timeout -k 5 "$(left "${TEST_S:-90}")" $PY -m pytest -v -m gpu tests/gpu/test_gpu_fp8_gemv_pipelined.py ${MORE_TESTS:-} \
    ${KEYS:+-k "$KEYS"} -p no:cacheprovider -rfE 2>&1 | tee "$OUT_DIR/fp8-pipelined-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -12
  for run in ${RUNS:-32b-fp8 32b 4b-fp8}; do
    cfg=qwen3-${run%-fp8}; q=(); [ "$run" != "${run%-fp8}" ] && q=(--quantization fp8)
    bench "$(left 170)" --config "$cfg" --arms native --workload latency --max-num-seqs 1 --time-limit 10 "${q[@]}"
  done
  echo "fp8-pipelined done in $(($(date +%s) - start)) s"
elif [ "${MODE:-fp8}" = fp8-block ]; then
  export FXREWRITE_FP8_TUNE_LOG="$OUT_DIR/fp8-tune.jsonl" FXREWRITE_GEMV_TUNE_LOG="$OUT_DIR/gemv-tune.jsonl"
  timeout -k 5 "$(left "${TEST_S:-90}")" $PY -m pytest -q -m gpu tests/gpu/test_gpu_fp8_gemv_pipelined.py -p no:cacheprovider \
    -rfE 2>&1 | tee "$OUT_DIR/fp8-block-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -12
  [ "${GEMM:-1}" = 1 ] && timeout -k 5 "$(left 120)" $PY -m fxrewrite.benchmarks.fp8_gemm --models qwen3-32b,qwen3-4b --tokens 1 --out "$OUT_DIR/gemm" \
    2>&1 | tee "$OUT_DIR/gemm.log" | grep -E "bf16|pipelined|tuner" | tail -50
  BLOCK='{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}'
  for run in ${RUNS:-32b-block 32b}; do (
    OUT_DIR=$OUT_DIR/$run; mkdir -p "$OUT_DIR"
    case $run in
      32b-block) bench "$(left 150)" --config qwen3-32b --arms native --workload latency --max-num-seqs 1 --time-limit 10 --hf-overrides "$BLOCK" ;;
      32b) bench "$(left 90)" --config qwen3-32b --arms native --workload latency --max-num-seqs 1 --time-limit 10 ;;
      4b-block) bench "$(left 90)" --config qwen3-4b --arms native --workload latency --max-num-seqs 1 --time-limit 10 --hf-overrides "$BLOCK" ;;
      4b-fp8kv) bench "$(left 180)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 --quantization fp8 --kv-cache-dtype fp8 ;;
      4b) bench "$(left 150)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 ;;
      4b-latency) bench "$(left 150)" --config qwen3-4b --arms native,after --workload latency --max-num-seqs 1 --time-limit 10 ;;
      4b-profile) timeout -k 5 "$(left 120)" $PY -m fxrewrite.benchmarks.profile_decode --config qwen3-4b --arm native \
        --batch 1 --out "$OUT_DIR" 2>&1 | tail -3 ;;
    esac ) done
  echo "fp8-block done in $(($(date +%s) - start)) s"
elif [ "${MODE:-fp8}" = kv-fp8 ]; then
  export FXREWRITE_FP8_TUNE_LOG="$OUT_DIR/fp8-tune.jsonl"
  timeout -k 5 "$(left 170)" $PY -m pytest -v -m gpu tests/kernels/test_fp8_kv_cache.py tests/gpu/test_gpu_fp8_kv_cache.py \
    -p no:cacheprovider -rfE 2>&1 | tee "$OUT_DIR/kv-fp8-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -12
  [ "${KERNEL:-1}" = 1 ] && timeout -k 5 "$(left 100)" $PY -m fxrewrite.benchmarks.kv_cache_fp8 --out "$OUT_DIR" 2>&1 \
    | grep -E "^(bf16|fp8)|wrote"
  bench "$(left 90)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 --kv-cache-dtype fp8
  bench "$(left 70)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15
  bench "$(left 150)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 --quantization fp8 --kv-cache-dtype fp8
  for q in ${PROFILES:-}; do
    timeout -k 5 "$(left 80)" $PY -m fxrewrite.benchmarks.profile_decode --config qwen3-4b --batch 200 --context 560 \
      --kv-cache-dtype fp8 $([ $q = fp8 ] && echo --quantization fp8) "${TOK[@]}" --out "$OUT_DIR" 2>&1 | grep -E "graph|us  x" | head -14
  done
  echo "kv-fp8 done in $(($(date +%s) - start)) s"
elif [ "${MODE:-fp8}" = fp8-rowwise ]; then
  export FXREWRITE_FP8_TUNE_LOG="$OUT_DIR/fp8-tune.jsonl"
  bench "$(left 220)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15 --quantization fp8
  bench "$(left 80)" --config qwen3-4b --arms native --num-prompts 200 --time-limit 15
  for q in ${PROFILES:-fp8 none}; do
    timeout -k 5 "$(left 80)" $PY -m fxrewrite.benchmarks.profile_decode --config qwen3-4b --batch 200 --context 560 \
      $([ $q = fp8 ] && echo --quantization fp8) "${TOK[@]}" --out "$OUT_DIR" 2>&1 | grep -E "graph|us  x" | head -14
  done
  [ "${TESTS:-1}" = 1 ] && timeout -k 5 "$(left 120)" $PY -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py \
    tests/gpu/test_gpu_fp8_quant.py -p no:cacheprovider -rfE -s -k "rowwise or quant" 2>&1 \
    | tee "$OUT_DIR/fp8-rowwise-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -12
  [ "${TESTS:-1}" = 1 ] && timeout -k 5 "$(left 40)" $PY -m fxrewrite.benchmarks.fp8_quant --out "$OUT_DIR" 2>&1 | tail -8
  [ -n "${TOKENS:-}" ] && timeout -k 5 "$(left 150)" $PY -m fxrewrite.benchmarks.fp8_gemm --models qwen3-4b \
    --tokens "$TOKENS" --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/fp8-rowwise-gemm.log" | grep -E "rowwise|bf16|tuner" | tail -70
  echo "fp8-rowwise done in $(($(date +%s) - start)) s"
elif [ "${MODE:-fp8}" = fp8 ]; then
  timeout -k 5 240 $PY -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider -rfE -s 2>&1 \
    | tee "$OUT_DIR/fp8-tests.log" | grep -E "passed|failed|FAIL|Error|logprob|fp8 |None " | tail -20
  timeout -k 5 300 $PY -m fxrewrite.benchmarks.fp8_gemm --out "$OUT_DIR" 2>&1 | tail -3
elif [ "${MODE}" = fp8-4b ]; then
  bench 100 --config qwen3-4b --arms native --num-prompts 256 --time-limit 30 --quantization fp8
  bench 100 --config qwen3-4b --arms native --num-prompts 256 --time-limit 30
  bench 100 --config qwen3-4b --arms native --workload latency --max-num-seqs 8 --time-limit 30 --quantization fp8
  bench 100 --config qwen3-4b --arms native --workload latency --max-num-seqs 8 --time-limit 30
elif [ "${MODE}" = fp8-32b ]; then
  bench 140 --config qwen3-32b --arms native --workload latency --max-num-seqs 8 --time-limit 30 --quantization fp8
  bench 140 --config qwen3-32b --arms native --workload latency --max-num-seqs 8 --time-limit 30
else
  timeout -k 5 150 $PY -m pytest -q -m gpu tests/gpu/test_gpu_pipeline_parallel.py -p no:cacheprovider -rfE 2>&1 \
    | tee "$OUT_DIR/pp-tests.log" | tail -5
  bench 200 --config qwen3-32b --arms native --num-prompts 256 --time-limit 40 -pp 2
  bench 200 --config qwen3-32b --arms native --num-prompts 256 --time-limit 40 -tp 2
fi
