#!/usr/bin/env bash
# Where a throughput run's host time goes, one call (issue 19's Qwen3-4B FP8 >= 1.2x bf16: the FP8 steps are short
# enough for the host to set the pace). STEPS (default "syncs cprofile throughput"), CONFIG (qwen3-4b), ARM (native),
# FP8 (default "--quantization fp8 --kv-cache-dtype fp8"; empty: bf16), NUM_PROMPTS (200):
#   syncs:      find_host_syncs on the FP8 engine: the call stacks that made the host wait for the device, and each
#               launch's host time (torch.cuda.set_sync_debug_mode). ~1.5 min
#   cprofile:   the same run without the sync check, under cProfile: the functions of most own time. ~1.5 min
#   throughput: bench compare, bf16 then FP8, with the step profile's per-batch bands (host launch / wait, device
#               busy / idle from CUDA events). ~1.5 min an engine
# Results go to $OUT when set, else benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
CONFIG=${CONFIG:-qwen3-4b}
ARM=${ARM:-native}
read -r -a FP8_ARGS <<< "${FP8---quantization fp8 --kv-cache-dtype fp8}"  # FP8="" runs bf16
syncs() {  # syncs TIMEOUT LOG ARGS...
  local limit=$1 log=$2; shift 2
  timeout -k 5 "$limit" $PY -m fxrewrite.benchmarks.find_host_syncs --config "$CONFIG" --arm "$ARM" "${FP8_ARGS[@]}" \
    --num-prompts "${NUM_PROMPTS:-200}" --max-input-len 1024 --max-output-len 1024 "${TOK[@]}" --out "$OUT_DIR" "$@" \
    2>&1 | grep -Ev "^(INFO|DEBUG)|it/s\]$" > "$OUT_DIR/$log"
  head -c 3000 "$OUT_DIR/$log"
}
bench() { timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 \
  | tee -a "$OUT_DIR/bench.log" | grep -v "it/s\]$" | grep -Ev "^(INFO|DEBUG)" | tail -4; }
for step in ${STEPS:-syncs cprofile throughput}; do
  case "$step" in
    syncs) syncs "$(left 150)" host-syncs.log; stamp "syncs done" ;;
    cprofile) syncs "$(left 150)" host-cprofile.log --no-sync-debug --cprofile 45; stamp "cprofile done" ;;
    throughput)
      bench "$(left 150)" --config "$CONFIG" --arms "$ARM" --num-prompts "${NUM_PROMPTS:-200}" --time-limit 15
      bench "$(left 150)" --config "$CONFIG" --arms "$ARM" --num-prompts "${NUM_PROMPTS:-200}" --time-limit 15 \
        "${FP8_ARGS[@]}"
      stamp "throughput done" ;;
    *) echo "step $step: expected syncs, cprofile or throughput"; exit 2 ;;
  esac
done
