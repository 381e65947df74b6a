#!/usr/bin/env bash
# Issue 13 (data parallel + expert parallel) on nvidia-h200-x2; one call per MODE (each under 10 min):
#   MODE=test: tests/gpu/test_gpu_data_parallel.py: greedy tokens (float32) of a 2-layer model with
#              Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048), DP2+EP2 and TP=2 against TP=1.
#   MODE=dp:   Qwen3-30B-A3B (48 layers, dummy bf16 weights) throughput, after and native arms, DP2+EP2.
#   MODE=tp:   the same at TP=2 (the comparison issue 13 asks for).
#   MODE=graphs: MODE=test's greedy tests (DP2+EP2 decode waves now in CUDA graphs, reduce-scatter combine),
#              then MODE=dp's throughput with a shorter time limit (one call of the device tool, < 10 min).
#   MODE=dp-pp: <= 5 min in all, each step capped by what is left of 300 s: Qwen3-30B-A3B DP2+EP2 (after
#              arm, decode waves in CUDA graphs, 20 s limit) with every worker's load phases on stderr and the
#              watchdog at 20 s (a phase that lasts longer prints its name and every thread's Python stack;
#              dp-ep-load.log has the whole output); then Qwen3-32B throughput at PP=2 (even split, then
#              VLLM_PP_LAYER_PARTITION=33,31: the last stage also runs lm_head + sampler), 20 s limit each,
#              JSONs in pp-even/ and pp-33-31/ (compare with the TP=2 JSON of 2026-12-01).
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
  dp-pp)
    left() { local c=$1 l=$((300 - $(date +%s) + start)); [ "$l" -lt "$c" ] && c=$l; [ "$c" -lt 10 ] && c=10; echo "$c"; }
    mkdir -p "$OUT_DIR/pp-even" "$OUT_DIR/pp-33-31"
    FXREWRITE_WATCHDOG_S=20 FXREWRITE_LOAD_LOG=1 timeout -k 5 "$(left 140)" $PY -m fxrewrite bench compare \
      --config qwen3-30b-a3b --arms after --num-prompts 256 --time-limit 20 -dp 2 --enable-expert-parallel \
      "${TOK[@]}" --out "$OUT_DIR" > "$OUT_DIR/dp-ep-load.log" 2>&1; echo "dp-ep exit $?"
    log="$OUT_DIR/dp-ep-load.log"
    for r in 0 1; do grep "^\[fxrewrite load\] DP rank $r " "$log" | grep -v ": capture$" | tail -3; done
    grep -m2 -A40 "^\[fxrewrite watchdog\]" "$log" | cut -c1-240 | head -90
    grep -E "^\[bench\]|Error|Traceback" "$log" | cut -c1-400 | tail -8
    timeout -k 5 "$(left 85)" $PY -m fxrewrite bench compare --config qwen3-32b --arms native --num-prompts 256 \
      --time-limit 25 -pp 2 --note "PP=2 even split" "${TOK[@]}" --out "$OUT_DIR/pp-even" 2>&1 | grep "^\[bench\] native"
    VLLM_PP_LAYER_PARTITION=33,31 timeout -k 5 "$(left 85)" $PY -m fxrewrite bench compare --config qwen3-32b \
      --arms native --num-prompts 256 --time-limit 25 -pp 2 --note "PP=2 layers 33,31" "${TOK[@]}" \
      --out "$OUT_DIR/pp-33-31" 2>&1 | grep "^\[bench\] native"
    echo "dp-pp done in $(($(date +%s) - start)) s" ;;
  tp) bench 540 --config qwen3-30b-a3b --arms after,native --num-prompts 256 --time-limit 60 -tp 2 ;;
  *) echo "MODE must be test, dp, tp, graphs or dp-pp"; exit 2 ;;
esac
