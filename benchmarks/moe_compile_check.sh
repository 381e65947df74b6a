#!/usr/bin/env bash
# torch.compile of MoE models (the fused experts as custom ops, no graph break) on one GPU, one call per MODE:
#   MODE=serve: the compile GPU tests (moe-compile-tests.log: 10-layer -O 3 engines, dense and MoE; a compiled
#               Qwen3-30B-A3B-shaped training step); Qwen3-30B-A3B batch-1 decode, after arm, -O 0 then -O 3
#               (latency JSONs, -O3 in the second one's name); THROUGHPUT=1: then Qwen3-4B throughput, after arm,
#               -O 0 then -O 3. ~8 min
#   MODE=train: training benchmark on Qwen3-30B-A3B's layers cut to LAYERS (default 4) decoder layers: stock,
#               stock-compile, optimize, optimize-compile (ARMS to change), bf16, batch BATCH x SEQ (2 x 2048),
#               checkpointed, STEPS timed steps after 2 warm-up (default 4). ~8 min
# Results (JSON, logs) go to $OUT when set, else benchmarks/results. Each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench() { timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" "${TOK[@]}" --out "$OUT_DIR" 2>&1 \
  | tee -a "$OUT_DIR/bench.log" | grep -v "it/s\]$" | grep -Ev "^(INFO|DEBUG)" | tail -8; }
case "${MODE:-serve}" in
  serve)
    timeout -k 5 "$(left 240)" $PY -m pytest -v -m gpu tests/gpu/test_gpu_compile.py tests/gpu/test_gpu_training.py \
      -k "moe or deep" -p no:cacheprovider -rfE 2>&1 \
      | tee "$OUT_DIR/moe-compile-tests.log" | grep -E "passed|failed|FAIL|Error|assert" | tail -12
    stamp "tests done"
    bench "$(left 110)" --config qwen3-30b-a3b --arms after --workload latency --max-num-seqs 1 --time-limit 10
    stamp "-O 0 done"
    bench "$(left 200)" --config qwen3-30b-a3b --arms after --workload latency --max-num-seqs 1 --time-limit 10 -O 3
    stamp "-O 3 done"
    if [ -n "${THROUGHPUT:-}" ]; then  # issue 14's -O 3 against -O 0: Qwen3-4B throughput, after arm
      bench "$(left 90)" --config qwen3-4b --arms after --num-prompts 256 --time-limit 15
      bench "$(left 150)" --config qwen3-4b --arms after --num-prompts 256 --time-limit 15 -O 3
      stamp "throughput done"
    fi ;;
  train)
    spec="$OUT_DIR/qwen3-30b-a3b-${LAYERS:-4}-layers.json"
    $PY - "$spec" "${LAYERS:-4}" <<'EOF'
import json, sys
from fxrewrite.benchmarks.common import load_bench_config
spec = load_bench_config("qwen3-30b-a3b")
layers = int(sys.argv[2])
spec["name"] = f"qwen3-30b-a3b-{layers}-layers"
spec["source"] += f"; num_hidden_layers cut from 48 to {layers} for one GPU's training memory"
spec["config"]["num_hidden_layers"] = layers
open(sys.argv[1], "w").write(json.dumps(spec, indent=1))
EOF
    timeout -k 5 "$(left 530)" $PY -m fxrewrite bench train --config "$spec" \
      --arms "${ARMS:-stock,stock-compile,optimize,optimize-compile}" \
      --batch-size "${BATCH:-2}" --seq-len "${SEQ:-2048}" \
      --steps "${STEPS:-4}" --warmup 2 --arm-timeout "${ARM_TIMEOUT:-125}" --out "$OUT_DIR" 2>&1 \
      | tee "$OUT_DIR/moe-train.log" | grep -v "it/s\]$" | tail -12
    stamp "train done" ;;
  *) echo "MODE=${MODE}: expected serve or train"; exit 2 ;;
esac
