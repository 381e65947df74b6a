#!/usr/bin/env bash
# Batch-1 decode latency under each value of one environment switch, in one device call (<= BUDGET s): GPU tests
# first (TESTS, pytest arguments; TESTS="" skips them), then for each CONFIGS entry and each VALUES entry
# bench compare latency at max-num-seqs 1 (arms ARMS, default native,after), results under $OUT/<value>/.
# Usage (repo root, on the GPU machine):
#   OUT=<dir> VAR=FXREWRITE_PDL VALUES="off auto" CONFIGS="qwen3-4b" bash benchmarks/latency_ab.sh
# (STEP_S caps each compare, FIRST_STEP_S (default twice STEP_S) a config's first one, which pays the cold Triton
# compiles and the load-time tuning: 60-100 s for Qwen3-32B FP8 or Qwen3-30B-A3B on a fresh H200; PROFILE=1 adds the native arm's batch-1 per-kernel profile at the last value, with
# PROFILE_EXTRA's profile_decode arguments, word-split;
# EXTRA holds more bench compare arguments, word-split, e.g. EXTRA="--quantization fp8"; WORKLOAD replaces
# "--workload latency --max-num-seqs 1", e.g. WORKLOAD="--workload throughput --num-prompts 200"; NO_PNG=1 deletes
# the plots at the end: the device returns a limited number of files, and a call of many runs lost JSONs to them.)
set -o pipefail
source benchmarks/gpu_env.sh
: "${VAR:?VAR: the environment variable to switch}" "${VALUES:?VALUES: its values, space-separated}"

if [ -n "${TESTS:-}" ]; then
  stamp "GPU tests: $TESTS"
  timeout -k 5 "$(left "${TESTS_S:-150}")" $PY -m pytest -v --tb=short -rfEs -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | tee "$OUT_DIR/latency-ab-gpu-tests.log" | tail -8
fi
for config in ${CONFIGS:-qwen3-4b}; do
  cap=${FIRST_STEP_S:-$(( 2 * ${STEP_S:-120} ))}
  for value in $VALUES; do
    stamp "bench compare $config ${WORKLOAD:-latency} (${ARMS:-native,after}), $VAR=$value"
    # progress bars redraw with carriage returns: one line each, then dropped, so the result lines stay in the tail
    env "$VAR=$value" timeout -k 5 "$(left "$cap")" $PY -m fxrewrite bench compare --config "$config" \
      --arms "${ARMS:-native,after}" ${WORKLOAD:---workload latency --max-num-seqs 1} --time-limit "${ARM_TIME_LIMIT:-8}" \
      --note "$VAR=$value" ${EXTRA:-} "${TOK[@]}" --out "$OUT_DIR/$value" 2>&1 | tr '\r' '\n' \
      | grep -v "/s\]$\|^ *$\|tokenizer you are loading" | tail -6
    cap=${STEP_S:-120}
  done
  if [ -n "${PROFILE:-}" ]; then
    stamp "profile $config native, batch 1, $VAR=$value"
    env "$VAR=$value" timeout -k 5 "$(left 90)" $PY -m fxrewrite.benchmarks.profile_decode --config "$config" \
      --arm native --batch 1 ${PROFILE_EXTRA:-} "${TOK[@]}" --out "$OUT_DIR" 2>&1 | tail -14
  fi
done
[ -n "${NO_PNG:-}" ] && find "$OUT_DIR" -name '*.png' -delete
stamp "done"
