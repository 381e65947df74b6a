#!/usr/bin/env bash
# The second wave's GPU runs, in few calls of the device tool (each fits its 10-minute limit):
#   STEP=train (nvidia-h200):    training GPU tests; `bench train` on Qwen3-0.6B shapes, five arms, one process
#                                each (<date>-qwen3-0.6b-train.json); at most 500 s of limits, ~330 s expected
#   STEP=train-nogc (nvidia-h200): optimize on Qwen3-4B (GPU test), then the five arms without gradient
#                                checkpointing (<date>-qwen3-0.6b-train-no-gc.json); at most 500 s, ~330 s expected
#   STEP=saved-tensors (nvidia-h200): what stock, liger, optimize save for the backward (one layer)
#   STEP=train-chunks (nvidia-h200): fused linear cross-entropy time/memory per chunk size (<date>-flce-chunks.json),
#                                then the five arms with gradient checkpointing, compiled arms allowed 200 s each
#   STEP=train-eager (nvidia-h200): the fused q/k-norm + rotary GPU test, then liger vs optimize (eager) with
#                                and without gradient checkpointing into $OUT_DIR/eager/
#   STEP=train-kernels (nvidia-h200): compiled-training-step GPU tests; the arms liger, optimize-compile,
#                                optimize-compile-inductor (gradient checkpointing) into $OUT_DIR/kernels/
#   STEP=train-big (nvidia-h200): the five arms on CONFIG=qwen3-4b (default, BATCH=4) or CONFIG=llama-3.1-8b BATCH=1
#                                (gradient checkpointing; <date>-<config>-train.json); at most 520 s of arm limits
#   STEP=train-gaps (nvidia-h200):  for $PROFILE_ARMS (default stock liger optimize) on CONFIG/BATCH (default
#                                qwen3-0.6b, 8): GPU idle gaps by call site (train_gaps), host syncs and cProfile
#   STEP=train-profile (nvidia-h200): per-kernel GPU time of one step (gradient checkpointing; <arm>-profile.json) for
#                                $PROFILE_ARMS (default liger optimize optimize-compile), then the FP8 GPU tests
#   STEP=serve (nvidia-h200):    MoE throughput (Qwen3-30B-A3B shapes), -O 3 cold and warm start, FP8 GEMM,
#                                structured-output overhead
#   STEP=structured (nvidia-h200): structured-output overhead (JSON), then structured-output and embedding GPU tests
#   STEP=moe-profile (nvidia-h200): MoE kernel timings, decode profiles (after/native, batch 1/256), MoE latency
#   STEP=decode (nvidia-h200):   issue 14: Triton JIT warm-up and fused norm-rope + KV write GPU tests;
#                                Qwen3-0.6B throughput after,native and native,after (cold Triton cache);
#                                Qwen3-4B / Qwen3-32B batch-1 decode (native, after); Qwen3-4B decode profile
#   STEP=moe-decode (nvidia-h200): MoE GPU tests, the direct MoE kernels at T=1,8 (tile sweep of each kernel
#                                and every router launch shape, in CUDA graphs), Qwen3-30B-A3B batch-1/8 latency (after,
#                                native) and throughput as the full-batch decode window (after, native, before =
#                                transformers' eager experts loop; <date>-qwen3-30b-a3b-throughput-decode-window8.json)
#   STEP=compile (nvidia-h200): issue 14 item 1, at most 510 s of step limits: -O 3 vs -O 0 GPU tests (float32 greedy
#                                tokens); Qwen3-0.6B throughput, arms after,native: -O 3 cold (fresh Inductor and
#                                Triton caches), -O 3 warm (same caches, new processes), -O 0
#   STEP=compile-more (nvidia-h200): at most 430 s: Qwen3-4B -O 0 and -O 3 (after, native); COMPILE_OPS=1 adds (150 s)
#                                Qwen3-0.6B -O 3 with the Triton norm/activation ops (FXREWRITE_COMPILE_KERNELS=1)
#   STEP=multi (nvidia-h200-x2): symmetric-memory all-reduce, TP=2 vs TP=1 batch-1 decode (Qwen3-4B),
#                                TP=2 and PP=2 greedy tests, MoE expert parallel
# Results (JSON, PNG, logs) go to $OUT when set, else benchmarks/results. Each step has a hard time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
stamp() { echo "[gpu-wave +$(( $(date +%s) - start ))s] $*"; }
gpu_tests() {  # LIMIT LOG PATHS...
  timeout -k 5 "$1" $PY -m pytest -q -m gpu "${@:3}" -p no:cacheprovider -rfE -s 2>&1 | tee "$OUT_DIR/$2" \
    | grep -E "passed|failed|FAILED|Error|error" | tail -15
}
compare() {  # LIMIT ARGS...
  timeout -k 5 "$1" $PY -m fxrewrite bench compare "${@:2}" --out "$OUT_DIR" 2>&1 | grep -v "it/s\]$" | tail -6
}
case "${STEP:-train}" in
train)  # <= 9.5 min in all: tests <= 55 s, then the arms' limits (45+140+55+45+140 s = 425 s, outer 435 s)
  stamp "training GPU tests"
  gpu_tests 55 gpu-tests-training.log tests/gpu/test_gpu_training.py -k "not compiled_training_step and not 4b"
  stamp "bench train (Qwen3-0.6B shapes, batch 8 x 2048, gradient checkpointing)"
  timeout -k 5 435 $PY -m fxrewrite bench train --config qwen3-0.6b --arms stock,stock-compile,liger,optimize,optimize-compile \
    --batch-size 8 --seq-len 2048 --steps ${TRAIN_STEPS:-5} --warmup 2 --out "$OUT_DIR" \
    --arm-timeout 45,liger=55,stock-compile=140,optimize-compile=140 2>&1 | tail -14 ;;
train-chunks)
  stamp "fused linear cross-entropy per chunk size (Qwen3-0.6B shapes, 8 x 2048 tokens)"
  timeout -k 5 60 $PY -m fxrewrite.benchmarks.flce_chunks --out "$OUT_DIR/$(date +%F)-flce-chunks.json" 2>&1 | tail -7
  stamp "bench train (Qwen3-0.6B shapes, batch 8 x 2048, gradient checkpointing)"
  timeout -k 5 460 $PY -m fxrewrite bench train --config qwen3-0.6b --arms stock,stock-compile,liger,optimize,optimize-compile \
    --batch-size 8 --seq-len 2048 --steps ${TRAIN_STEPS:-5} --warmup 2 --arm-timeout 200 --out "$OUT_DIR" 2>&1 | tail -14 ;;
train-nogc)  # <= 9.5 min in all: optimize's own time on Qwen3-4B (<= 55 s), then the arms (425 s, outer 435 s)
  stamp "optimize on Qwen3-4B shapes (GPU test, target < 5 s)"
  gpu_tests 55 gpu-tests-optimize-4b.log tests/gpu/test_gpu_training.py -k 4b
  stamp "bench train (Qwen3-0.6B shapes, batch 8 x 2048, no gradient checkpointing)"
  timeout -k 5 435 $PY -m fxrewrite bench train --config qwen3-0.6b --arms stock,stock-compile,liger,optimize,optimize-compile \
    --batch-size 8 --seq-len 2048 --steps ${TRAIN_STEPS:-5} --warmup 2 --no-gradient-checkpointing --out "$OUT_DIR" \
    --arm-timeout 45,liger=55,stock-compile=140,optimize-compile=140 2>&1 | tail -14 ;;
saved-tensors)
  for arm in stock liger optimize; do
    stamp "saved tensors: $arm"
    timeout -k 5 40 $PY -m fxrewrite.benchmarks.saved_tensors --arm $arm --layers 1 --batch-size 8 --seq-len 2048 \
      --out "$OUT_DIR/$(date +%F)-qwen3-0.6b-saved-$arm.json" 2>&1 | tail -12
  done ;;
train-eager)
  stamp "fused q/k-norm + rotary GPU test"
  gpu_tests 120 gpu-tests-training-qk.log tests/gpu/test_gpu_training.py -k "qk_norm_rope or bf16_training_step"
  mkdir -p "$OUT_DIR/eager"
  for gc in "" --no-gradient-checkpointing; do
    stamp "bench train liger,optimize ${gc:-with gradient checkpointing}"
    timeout -k 5 200 $PY -m fxrewrite bench train --config qwen3-0.6b --arms liger,optimize --batch-size 8 \
      --seq-len 2048 --steps ${TRAIN_STEPS:-8} --warmup 2 --arm-timeout 90 $gc --out "$OUT_DIR/eager" 2>&1 | tail -5
  done ;;
train-kernels)  # <= 7.5 min: compiled-step GPU tests (<= 120 s), then liger and both compiled designs (<= 325 s)
  stamp "compiled training step GPU tests"
  gpu_tests 120 gpu-tests-training-compile.log tests/gpu/test_gpu_training.py -k compiled_training_step
  stamp "bench train: compiled arms, kernels as custom ops (default) or Inductor's references"
  mkdir -p "$OUT_DIR/kernels"
  timeout -k 5 330 $PY -m fxrewrite bench train --config qwen3-0.6b --arms liger,optimize-compile,optimize-compile-inductor \
    --batch-size 8 --seq-len 2048 --steps ${TRAIN_STEPS:-5} --warmup 2 --arm-timeout 140,liger=45 \
    --out "$OUT_DIR/kernels" 2>&1 | tail -8 ;;
train-big)  # issue 12 item 6: one larger config per call, <= 9.5 min (arms 60 / 200 s: at most 520 s)
  stamp "bench train (${CONFIG:=qwen3-4b} shapes, batch ${BATCH:=4} x 2048, gradient checkpointing)"
  timeout -k 5 560 $PY -m fxrewrite bench train --config $CONFIG --arms stock,stock-compile,liger,optimize,optimize-compile \
    --batch-size $BATCH --seq-len 2048 --steps ${TRAIN_STEPS:-5} --warmup 2 --out "$OUT_DIR" \
    --arm-timeout 60,stock-compile=170,optimize-compile=170 2>&1 | tail -14 ;;
train-gaps)  # where a step's GPU idles, by call site, and the host's own time: at most 3 x 100 s
  for arm in ${PROFILE_ARMS:-stock liger optimize}; do
    stamp "idle gaps and host profile: $arm (${CONFIG:=qwen3-0.6b}, batch ${BATCH:=8} x 2048)"
    timeout -k 5 50 $PY -m fxrewrite.benchmarks.train_gaps --arm $arm --config $CONFIG --batch-size $BATCH \
      --out "$OUT_DIR/$(date +%F)-$CONFIG-train-gaps-$arm.json" 2>&1 | grep -v -i warn | tail -12
    timeout -k 5 50 $PY -m fxrewrite.benchmarks.train_profile --arm $arm --config $CONFIG --batch-size $BATCH \
      --sync-debug --host-profile --out "$OUT_DIR/$(date +%F)-$CONFIG-train-host-profile-$arm.json" 2>&1 \
      | grep -E "ms/step|syncs from|host " | head -16
  done ;;
train-profile)  # at most 390 s of step limits
  for arm in ${PROFILE_ARMS:-liger optimize optimize-compile}; do
    stamp "profile: $arm"
    timeout -k 5 $([ $arm = optimize-compile ] && echo 120 || echo 60) $PY -m fxrewrite.benchmarks.train_profile \
      --arm $arm --out "$OUT_DIR/$(date +%F)-qwen3-0.6b-train-profile-$arm.json" 2>&1 | tail -27
  done
  stamp "FP8 GPU tests"
  timeout -k 5 150 $PY -m pytest -v -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider --tb=short -s 2>&1 \
    | tee "$OUT_DIR/gpu-tests-fp8.log" | grep -E "FAILED|Error|passed|failed|first-token|unavailable" | tail -12 ;;
serve)
  stamp "MoE GPU tests"
  gpu_tests 70 gpu-tests-moe.log tests/moe
  stamp "MoE throughput (Qwen3-30B-A3B shapes)"
  compare 200 --config qwen3-30b-a3b --arms after,native,before --num-prompts 256 --time-limit 25
  stamp "-O 3, cold then warm (Qwen3-0.6B shapes, after)"
  compare 150 --config qwen3-0.6b --arms after --num-prompts 256 --time-limit 20 -O 3 --note cold
  compare 90 --config qwen3-0.6b --arms after --num-prompts 256 --time-limit 20 -O 3 --note warm
  stamp "FP8 GEMM"
  timeout -k 5 60 $PY -m fxrewrite.benchmarks.fp8_gemm --out "$OUT_DIR" 2>&1 | tail -8
  stamp "structured outputs"
  timeout -k 5 70 $PY -m fxrewrite.benchmarks.structured_outputs --repeats 2 --out "$OUT_DIR" 2>&1 | tail -6 ;;
structured)  # issue 20: structured-output overhead and embeddings (nvidia-h200), at most 390 s of step limits
  stamp "structured outputs: overhead at batch 64 (none / schema in the grammar process (default) / main thread, 5 repeats interleaved), validity"
  timeout -k 5 240 $PY -m fxrewrite.benchmarks.structured_outputs "${TOK[@]}" --out "$OUT_DIR" 2>&1 | grep -v "tok/s\]" | tail -12
  stamp "structured-output and embedding GPU tests"
  gpu_tests 150 gpu-tests-structured.log tests/gpu/test_gpu_structured_outputs.py tests/gpu/test_gpu_embeddings.py ;;
decode)  # issue 14 (nvidia-h200): at most 590 s of step limits, about 8 minutes
  stamp "GPU tests: no Triton JIT after load, fused norm-rope + KV write, paged attention, CUDA graphs"
  gpu_tests 150 gpu-tests-decode.log tests/gpu/test_gpu_jit_warmup.py tests/kernels/test_qk_norm_rope_cache.py \
    tests/kernels/test_qk_norm_rope.py tests/kernels/test_paged_attention.py tests/gpu/test_gpu_cuda_graphs.py
  export TRITON_CACHE_DIR=$(mktemp -d)  # cold: the first arm compiles, as on a fresh machine
  for order in after,native native,after; do
    stamp "throughput (Qwen3-0.6B shapes), arms $order"
    mkdir -p "$OUT_DIR/order-${order/,/-}"
    timeout -k 5 100 $PY -m fxrewrite bench compare --config qwen3-0.6b --arms $order --note "arm order $order" \
      --out "$OUT_DIR/order-${order/,/-}" 2>&1 | grep -v "it/s\]$" | tail -5
  done
  stamp "batch-1 decode (Qwen3-4B, Qwen3-32B shapes)"
  compare 70 --config qwen3-4b --arms native,after --workload latency --max-num-seqs 1
  compare 120 --config qwen3-32b --arms native,after --workload latency --max-num-seqs 1
  stamp "decode profile, Qwen3-4B native batch 1"
  timeout -k 5 50 $PY -m fxrewrite.benchmarks.profile_decode --config qwen3-4b --arm native --batch 1 \
    "${TOK[@]}" --out "$OUT_DIR" 2>&1 | tail -14 ;;
compile|compile-more)  # issue 14 item 1: regional torch.compile (runtime/worker/compilation.py); one folder per run
  compare_in() {  # NAME LIMIT ARGS...: results in $OUT_DIR/compile-NAME/ (the JSON name carries no -O level)
    mkdir -p "$OUT_DIR/compile-$1"
    timeout -k 5 "$2" $PY -m fxrewrite bench compare "${@:3}" --note "$1" --out "$OUT_DIR/compile-$1" 2>&1 \
      | grep -v "it/s\]$" | tail -4
  }
  Q06=(--config qwen3-0.6b --arms after,native --num-prompts 256 --time-limit 12)
  if [ "$STEP" = compile ]; then
    stamp "GPU tests: compiled forward vs eager, -O 3 greedy tokens == -O 0 (float32)"
    gpu_tests 140 gpu-tests-compile.log tests/gpu/test_gpu_compile.py
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)  # cold: nothing compiled yet
    for note in cold warm; do  # warm: a new process per arm over the caches the cold run filled
      stamp "-O 3 $note start (Qwen3-0.6B shapes; setup_s = load + compile + CUDA graph capture)"
      compare_in "O3-$note" $([ $note = cold ] && echo 170 || echo 110) "${Q06[@]}" -O 3
    done
    stamp "-O 0 (CUDA graphs over the eager forward), the baseline"
    compare_in O0 90 "${Q06[@]}"
  else
    for level in 0 3; do
      stamp "Qwen3-4B shapes -O $level"
      compare_in "4b-O$level" $((150 + 130 * level / 3)) --config qwen3-4b --arms after,native --num-prompts 256 \
        --time-limit 15 -O $level
    done
    if [ "${COMPILE_OPS:-0}" = 1 ]; then
      stamp "-O 3 with RMSNorm / SiLU-and-mul as opaque Triton ops (FXREWRITE_COMPILE_KERNELS=1), Qwen3-0.6B"
      FXREWRITE_COMPILE_KERNELS=1 compare_in O3-triton-ops 150 "${Q06[@]}" -O 3
    fi
  fi ;;
multi)
  stamp "all-reduce"
  timeout -k 5 60 $PY -m fxrewrite.benchmarks.all_reduce --out "$OUT_DIR" 2>&1 | tail -8
  stamp "TP=2 batch-1 decode (Qwen3-4B shapes)"
  compare 120 --config qwen3-4b --arms native --workload latency --max-num-seqs 8 -tp 2 --time-limit 30
  stamp "TP=2 / PP=2 / MoE EP greedy tests"
  gpu_tests 200 gpu-tests-multi.log tests/gpu/test_gpu_tensor_parallel.py tests/gpu/test_gpu_pipeline_parallel.py ;;
moe-profile)
  stamp "MoE kernels (Qwen3-30B-A3B expert shapes)"
  timeout -k 5 90 $PY -m fxrewrite.benchmarks.moe_kernels --config qwen3-30b-a3b --out "$OUT_DIR" 2>&1 | tail -12
  for arm in after native; do for b in 1 256; do
    stamp "decode profile $arm batch $b"
    timeout -k 5 100 $PY -m fxrewrite.benchmarks.profile_decode --config qwen3-30b-a3b --arm $arm --batch $b \
      "${TOK[@]}" --out "$OUT_DIR" 2>&1 | tail -14
  done; done
  stamp "MoE batch-1/8 decode latency"
  compare 160 --config qwen3-30b-a3b --arms after,native --workload latency --max-num-seqs 8 --time-limit 30 ;;
moe-decode)  # issue 13 (nvidia-h200), at most 350 s of step limits: the few-token MoE path
  stamp "MoE GPU tests (router launch shapes and tuner, norm-folded router, direct kernels, fused MoE)"
  gpu_tests 75 gpu-tests-moe.log tests/moe
  stamp "MoE direct kernels T=1,8 (Qwen3-30B-A3B shapes; tile sweep in graphs; router: each launch shape, GEMM pair)"
  timeout -k 5 55 $PY -m fxrewrite.benchmarks.moe_kernels --config qwen3-30b-a3b --tokens 1,8 --sweep \
    --direct-only --out "$OUT_DIR" 2>&1 | grep -v "sweep" | tail -24
  export FXREWRITE_ROUTER_TUNE_LOG="$OUT_DIR/router-tune.jsonl"  # the load-time router choice of each engine arm
  stamp "MoE batch-1/8 decode latency (after, native)"
  compare 70 --config qwen3-30b-a3b --arms after,native --workload latency --max-num-seqs 8 --time-limit 20
  # before first: the slow arm (~2 s per step) gets the time; after and native stop ~4 s into their timed runs
  stamp "MoE throughput, full-batch decode window of 8 steps after all 256 prefills (before, after, native)"
  compare 150 --config qwen3-30b-a3b --arms before,after,native --num-prompts 256 --decode-window 8 --time-limit 55 ;;
esac
stamp done
