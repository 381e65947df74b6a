#!/usr/bin/env bash
# Issue 14: -O 3 (torch.compile + CUDA graphs) against -O 0 (CUDA graphs of the eager forward) on one GPU, one call.
# STEPS (default "profiles throughput before"), CONFIG (qwen3-4b):
#   profiles:    per-kernel decode profiles (profile_decode --batch BATCHES, default 1,64,256, context CONTEXT, 512) of
#                the after arm, one engine per setting: -O 0, -O 3 (each decode graph the faster of its compiled and
#                eager forwards, both timed at capture: the JSON's graph_choice_replay_ms), and -O 3 with
#                FXREWRITE_COMPILED_FORWARD=compiled (every graph compiled). ~3 min
#   profile-O3:  only the -O 3 one of those. ~1 min
#   throughput:  ARMS (default after; comma list), 256 prompts, -O 0 then -O 3. ~1.5 min an arm
#   cold-warm:   Qwen3-0.6B throughput, COLD_ARMS (default after,native): -O 0 (skipped with COLD_BASELINE=0), then
#                -O 3 twice on a fresh compile cache (cold start, then warm: the setup_s of each). ~2 min an arm
#   tests:       the compile GPU tests (tests/gpu/test_gpu_compile.py; log compile-tests.log). ~2 min
#   before:      the before arm's profiles (transformers code, no rewrite: Inductor's fusions have most to do), -O 0
#                and -O 3. ~2 min
# Results go to $OUT when set, else benchmarks/results: logs profile-<setting>.log, JSONs in <setting>/.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
profile() {  # profile TIMEOUT SETTING ARM ARGS...: one engine, every batch size; log in profile-SETTING.log
  local limit=$1 setting=$2 arm=$3; shift 3
  timeout -k 5 "$limit" $PY -m fxrewrite.benchmarks.profile_decode --config "${CONFIG:-qwen3-4b}" --arm "$arm" \
    --batch "${BATCHES:-1,64,256}" --context "${CONTEXT:-512}" "${TOK[@]}" --out "$OUT_DIR/$setting" "$@" 2>&1 \
    | grep -Ev "^(INFO|DEBUG)" > "$OUT_DIR/profile-$setting.log"
  grep -E "graph .* ms|us of kernels" "$OUT_DIR/profile-$setting.log" | tail -12
  stamp "$setting done"
}
bench() { timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 \
  | tee -a "$OUT_DIR/bench.log" | grep -v "it/s\]$" | grep -Ev "^(INFO|DEBUG)" | tail -6; }
for step in ${STEPS:-profiles throughput before}; do
  case "$step" in
    profiles)
      profile "$(left 100)" after-O0 after -O 0
      profile "$(left 150)" after-O3 after -O 3
      FXREWRITE_COMPILED_FORWARD=compiled profile "$(left 150)" after-O3-compiled after -O 3 ;;
    profile-O3)
      profile "$(left 150)" after-O3 after -O 3 ;;
    throughput)
      bench "$(left 200)" --config "${CONFIG:-qwen3-4b}" --arms "${ARMS:-after}" --num-prompts 256 --time-limit 15
      bench "$(left 250)" --config "${CONFIG:-qwen3-4b}" --arms "${ARMS:-after}" --num-prompts 256 --time-limit 15 -O 3
      stamp "throughput done" ;;
    cold-warm)
      [ "${COLD_BASELINE:-1}" = 0 ] \
        || bench "$(left 120)" --config qwen3-0.6b --arms "${COLD_ARMS:-after,native}" --num-prompts 256 --time-limit 15
      export FXREWRITE_CACHE=/tmp/fxrewrite-cache-cold-warm
      rm -rf "$FXREWRITE_CACHE"
      for phase in cold warm; do
        bench "$(left 150)" --config qwen3-0.6b --arms "${COLD_ARMS:-after,native}" --num-prompts 256 \
          --time-limit 15 -O 3
        for f in "$OUT_DIR"/*-qwen3-0.6b-throughput-O3.json; do mv "$f" "${f%.json}-$phase.json"; done
      done
      stamp "cold-warm done" ;;
    tests)
      timeout -k 5 "$(left 200)" $PY -m pytest -v -m gpu tests/gpu/test_gpu_compile.py -p no:cacheprovider -rfE 2>&1 \
        | tee "$OUT_DIR/compile-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -12
      stamp "tests done" ;;
    before)
      profile "$(left 100)" before-O0 before -O 0
      profile "$(left 150)" before-O3 before -O 3 ;;
    *) echo "step $step: expected profiles, profile-O3, throughput, cold-warm, tests or before"; exit 2 ;;
  esac
done
