#!/usr/bin/env bash
# The split decode's merge inside the decode kernel (the last split program to arrive merges the partials)
# against the merge launch it replaced, in one device call (<= BUDGET s): the GPU tests of the decode kernels,
# then for each CONFIGS entry bench compare latency at max-num-seqs 1 with FXREWRITE_DECODE_MERGE=launch (native)
# and =kernel (native,after), and the native arm's batch-1 per-kernel profile with the merge in the kernel.
# Usage (repo root, on the GPU machine): OUT=<dir> CONFIGS="qwen3-4b" bash benchmarks/decode_merge_check.sh
# (TESTS="" skips the tests; STEP_S caps each compare.)
set -o pipefail
source benchmarks/gpu_env.sh

if [ -n "${TESTS-x}" ]; then
  stamp "GPU tests (decode kernels, PDL, JIT warm-up)"
  timeout -k 5 "$(left "${TESTS_S:-150}")" $PY -m pytest -q -rs -m gpu -p no:cacheprovider \
    ${TESTS:-tests/kernels/test_paged_attention.py tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_jit_warmup.py} 2>&1 \
    | tee "$OUT_DIR/decode-merge-gpu-tests.log" | tail -8
fi
for config in ${CONFIGS:-qwen3-4b}; do
  for merge in launch kernel; do
    arms=native; [ "$merge" = kernel ] && arms=native,after
    stamp "bench compare $config latency ($arms), FXREWRITE_DECODE_MERGE=$merge"
    FXREWRITE_DECODE_MERGE=$merge timeout -k 5 "$(left "${STEP_S:-120}")" $PY -m fxrewrite bench compare \
      --config "$config" --arms "$arms" --workload latency --max-num-seqs 1 --time-limit "${ARM_TIME_LIMIT:-8}" \
      --note "FXREWRITE_DECODE_MERGE=$merge" "${TOK[@]}" --out "$OUT_DIR/$merge" 2>&1 | grep -v "it/s\]$" | tail -6
  done
  stamp "profile $config native, batch 1"
  timeout -k 5 "$(left 90)" $PY -m fxrewrite.benchmarks.profile_decode --config "$config" --arm native --batch 1 \
    "${TOK[@]}" --out "$OUT_DIR" 2>&1 | tail -14
done
stamp "done"
