#!/usr/bin/env bash
# `make gpu-check`, on the GPU machine (the device tool), from the repository root, in one call:
#   1. install what the machine lacks from .whl (see /work/shared/tools/device-wheels) + this repo, editable;
#   2. the GPU-only tests (pytest -m gpu);
#   3. a short compare: the throughput workload on Qwen3-0.6B shapes through before/after/native/hf,
#      then batch-1/8 decode latency on Qwen3-4B shapes (native);
#   4. a table of the results, printed last.
# Every step has its own hard time limit, so the whole script stays under ~9 minutes. Results (JSON,
# PNG, logs) go to $OUT when set (the device tool's output folder), else benchmarks/results.
# Knobs (environment): NUM_PROMPTS (256), HF_NUM_PROMPTS (48), ARM_TIME_LIMIT (40 s), ARMS (before,after,native,hf),
# OPT_LEVEL (-O for the engine arms: 0 = CUDA graphs only, 3 = also torch.compile; default 0),
# TEST_PATHS (tests), SHARD=i/n (the i-th of n groups of test files: the whole GPU suite takes ~15 min), SKIP_TESTS=1, SKIP_THROUGHPUT=1, SKIP_LATENCY=1, RUN_LONG=1 (the 32k/64k/128k YaRN run on Qwen3-0.6B).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
stamp() { echo "[gpu-check +$(( $(date +%s) - start ))s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT_DIR/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
paths=(${TEST_PATHS:-tests})
if [ -n "${SHARD:-}" ]; then  # i/n: every n-th file holding GPU tests, from the i-th (the suite needs ~3 calls)
  mapfile -t files < <($PY -m pytest --collect-only -q -m gpu "${paths[@]}" -p no:cacheprovider 2>/dev/null \
    | sed -n 's/::.*//p' | sort -u)
  paths=(); for j in "${!files[@]}"; do (( j % ${SHARD#*/} == ${SHARD%/*} - 1 )) && paths+=("${files[j]}"); done
fi
stamp "GPU tests: ${paths[*]}"
timeout -k 5 ${TEST_TIMEOUT:-300} $PY -m pytest -v -m gpu "${paths[@]}" -p no:cacheprovider \
  -rfE --durations=8 2>&1 | tee "$OUT_DIR/gpu-tests.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|s call|Error" | tail -60
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT_DIR/gpu-tests.log"
fi

if [ -z "${SKIP_THROUGHPUT:-}" ]; then
stamp "throughput compare (Qwen3-0.6B shapes)"
arms=${ARMS:-before,after,native,hf}
HF=(); [[ ",$arms," == *,hf,* ]] && HF=(--hf-num-prompts "${HF_NUM_PROMPTS:-48}")  # refused without the hf arm
timeout -k 5 ${COMPARE_TIMEOUT:-300} $PY -m fxrewrite bench compare --config qwen3-0.6b \
  --arms "$arms" --num-prompts "${NUM_PROMPTS:-256}" "${HF[@]}" --time-limit "${ARM_TIME_LIMIT:-40}" -O "${OPT_LEVEL:-0}" \
  "${TOK[@]}" --out "$OUT_DIR" 2>&1 | grep -v "it/s\]$" | tail -30
fi

if [ -z "${SKIP_LATENCY:-}" ]; then
stamp "latency (Qwen3-4B shapes, native)"
timeout -k 5 ${LATENCY_TIMEOUT:-80} $PY -m fxrewrite bench compare --config qwen3-4b --arms native \
  --workload latency --max-num-seqs 8 --time-limit 30 -O "${OPT_LEVEL:-0}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 | tail -12
fi

if [ -n "${RUN_LONG:-}" ]; then
stamp "long context (Qwen3-0.6B shapes, YaRN x4, ${LONG_ARMS:-native})"
timeout -k 5 ${LONG_TIMEOUT:-200} $PY -m fxrewrite bench compare --config qwen3-0.6b --arms "${LONG_ARMS:-native}" \
  --workload long --time-limit 60 -O "${LONG_OPT_LEVEL:-${OPT_LEVEL:-0}}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 | tail -12
fi

stamp "done"
# this run's comparisons only ($OUT_DIR is benchmarks/results without $OUT: every earlier result lies there too)
$PY -c 'import sys; from fxrewrite.benchmarks.compare import format_tables as t; print(); print(t(sys.argv[1], float(sys.argv[2])))' \
  "$OUT_DIR" "$start"
