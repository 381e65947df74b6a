#!/usr/bin/env bash
# Batch-1 decode on the GPU in one device call (<= ~6 min): the decode-chain microbenchmark (PDL off / on, GEMV
# variants, Qwen3-4B + 32B shapes), the PDL / skinny GEMV GPU tests, then bench compare latency at
# max-num-seqs 1 for Qwen3-4B and Qwen3-32B (native,after), FXREWRITE_PDL=on and off (the default was off when it was written;
# kernels/pdl.py has the measurements).
# Usage (repo root, on the GPU machine): OUT=<dir> bash benchmarks/gemv_gpu.sh   (default OUT benchmarks/results)
# RUN_SWEEP=1 also runs the full GEMV sweep (fxrewrite.benchmarks.gemv, M = 1..8, ~150 s) first.
set -o pipefail
BUDGET=${BUDGET:-355}
source benchmarks/gpu_env.sh
export FXREWRITE_GEMV_TUNE_LOG="$OUT_DIR/gemv-tune.jsonl"

if [ -n "${RUN_SWEEP:-}" ]; then
  stamp "GEMV sweep"
  timeout -k 5 150 $PY -m fxrewrite.benchmarks.gemv --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gemv-bench.log" | tail -45
fi

# the microbenchmark first: its parallel build fills Triton's cache for the tests and the engines
stamp "decode chain microbenchmark"
timeout -k 5 "$(left 130)" $PY -m fxrewrite.benchmarks.decode_chain --layers "${CHAIN_LAYERS:-8}" --out "$OUT_DIR" \
  2>&1 | tee "$OUT_DIR/decode-chain.log" | tail -40

stamp "GPU tests (PDL in CUDA graphs, split-K GEMV, engine decode logits with the GEMV)"
timeout -k 5 "$(left 90)" $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu/test_gpu_pdl.py \
  tests/gpu/test_gpu_skinny_gemv.py -k "pdl or logits or engine_load" 2>&1 | tee "$OUT_DIR/pdl-gpu-tests.log" | tail -15

compare() {  # config pdl seconds
  stamp "bench compare $1 latency, FXREWRITE_PDL=$2"
  FXREWRITE_PDL=$2 timeout -k 5 "$(left "$3")" $PY -m fxrewrite bench compare --config "$1" --arms native,after \
    --workload latency --max-num-seqs 1 --time-limit "${ARM_TIME_LIMIT:-8}" --note "FXREWRITE_PDL=$2" "${TOK[@]}" \
    --out "$OUT_DIR/pdl-$2" 2>&1 | grep -v "it/s\]$" | tail -8
}
compare qwen3-4b on 60
compare qwen3-4b off 60
compare qwen3-32b on 75
compare qwen3-32b off 75

stamp "summary"
$PY - "$OUT_DIR" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for pdl in ("on", "off"):
    for path in sorted((out / f"pdl-{pdl}").glob("*latency*.json")):
        for arm, r in json.loads(path.read_text())["arms"].items():
            b = r.get("batch_1", {})
            print(f"PDL {pdl:3s} {path.stem:32s} {arm:7s} decode {b.get('decode_ms_per_step')} ms/step, "
                  f"graph {b.get('graph_replay_ms')} ms, roofline {b.get('roofline_fraction')}")
PYEOF
echo "gemv_gpu.sh: $(( $(date +%s) - start )) s"
