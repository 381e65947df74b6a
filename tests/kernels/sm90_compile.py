"""Compile kernels for sm90 (H100/H200) with no GPU: triton's compiler to the cubin.
``python -m tests.kernels.sm90_compile fp8e4nv|fp8e5`` (TRITON_INTERPRET unset): the FP8 KV-cache paths of the
attention kernels, then a JSON line about the decode kernel's PTX (run by tests/kernels/test_fp8_kv_cache.py);
``... fp8-gemv-pipelined``: the pipelined one-token FP8 GEMV, then a JSON line about its loads
(tests/kernels/test_fp8_gemv_pipelined.py); ``... skinny-gemv-pipelined``: the pipelined one-token bf16 GEMV beside the
skinny GEMV it competes with, a JSON line about each one's loads (tests/kernels/test_skinny_gemv_pipelined.py);
``... greedy-sample``: greedy sampling's two kernels for bf16 and float32 logits (tests/kernels/test_greedy_sample.py)."""

from __future__ import annotations

import json
import re
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile

from fxrewrite.kernels import (fp8_gemv_pipelined, greedy_sample, moe_norm_router, paged_decode, paged_prefill, qk_norm_rope_cache,
                               reshape_and_cache, skinny_gemv, skinny_gemv_pipelined)


def compile_sm90(fn, pointers: dict, constexprs: dict, floats=("scale", "soft_cap"), **options) -> str:
    """PTX of `fn` for sm90 (the cubin is built too). Pointers and integer arguments are declared 16-divisible,
    as the JIT specialises the engine's strides and buffers, so loads vectorise as on the GPU; the packed length
    buffers are not (the kernels opt out of that specialisation)."""
    sig = {n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n in floats else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n not in ("seq_lens_ptr", "qsl_ptr")}
    kernel = triton_compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 64), options=options)
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


_INTS = {n: "*i32" for n in ("bt_ptr", "seq_lens_ptr", "qsl_ptr")} | {"sinks_ptr": "*fp32"}
_DECODE_POINTERS = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", **_INTS}


def _early(cache: str, early: bool = True) -> dict:
    """The decode kernel's PDL early-load constexprs over a `cache` of 128-wide heads (kernels/pdl.py early_loads)."""
    line = 128 if cache.startswith("fp8") else 64
    return dict(EARLY=early, LINE=line, ROW_LINES=128 // line)


def main(cache: str) -> dict:
    caches = {"kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}"}
    ints = _INTS
    common = dict(HEAD_DIM=128, BLOCK_D=128, HAS_SOFTCAP=False, HAS_WINDOW=False, HAS_SINKS=False, DOT_PRECISION="tf32",
                  FP16_DOTS=True, WIDEN_ASM=1 if cache == "fp8e4nv" else 2)
    early = _early(cache)
    decode = compile_sm90(paged_decode._decode_kernel,
                          {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", **caches,
                           **ints},
                          dict(common, G=4, BLOCK_G=16, BLOCK_N=64, IS_SPLIT=True, KEYS_MAJOR=False, F8_DOTS=False, EXACT_CAST=False,
                               V_RUN=0, PDL=True, **early), num_warps=4, num_stages=2)
    float8_mma, v_loads = [], {}
    if cache == "fp8e4nv":  # fp8_dots="float8": both dots on FP8 tensor cores, no widening
        for v_run in (0, 16):  # V rows as stored, V^T from a keys-contiguous value cache (blocks of 16)
            float8 = compile_sm90(paged_decode._decode_kernel,
                                  {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32",
                                   **caches, **ints},
                                  dict(common, FP16_DOTS=False, WIDEN_ASM=0, G=4, BLOCK_G=8, BLOCK_N=128, IS_SPLIT=True,
                                       KEYS_MAJOR=True, F8_DOTS=True, EXACT_CAST=False, V_RUN=v_run, PDL=True, **early),
                                  num_warps=4, num_stages=2)
            v_loads[v_run] = {"cp_async": float8.count("cp.async.cg"), "byte_loads": float8.count("ld.global.b8"),
                              "shared_stores": len(re.findall(r"st\.shared", float8))}
        float8_mma = sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.\S*", float8)))
        float8_mma.append(f"widened: {float8.count('cvt.rn.f16x2.e4m3x2')}")
    for v_run in (0, 16):  # value rows as stored; a keys-contiguous value cache
        compile_sm90(paged_prefill._prefill_kernel, {"q_ptr": "*bf16", "out_ptr": "*bf16", **caches, **ints},
                     dict(common, G=4, BLOCK_M=64, BLOCK_N=64, HAS_SOFTCAP=True, HAS_WINDOW=True, V_RUN=v_run),
                     num_warps=4)
    # attention sinks (GPT-OSS): the decode split and keys-major tiles, and the prefill
    for keys_major in (False, True):
        compile_sm90(paged_decode._decode_kernel,
                     {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", **caches, **ints},
                     dict(common, HAS_SINKS=True, HAS_WINDOW=True, G=8, BLOCK_G=8 if keys_major else 16, BLOCK_N=64,
                          IS_SPLIT=True, KEYS_MAJOR=keys_major, F8_DOTS=False, EXACT_CAST=False, V_RUN=0, PDL=True,
                          **early),
                     num_warps=4, num_stages=2)
    compile_sm90(paged_prefill._prefill_kernel, {"q_ptr": "*bf16", "out_ptr": "*bf16", **caches, **ints},
                 dict(common, HAS_SINKS=True, G=8, BLOCK_M=64, BLOCK_N=64, V_RUN=0), num_warps=4)
    compile_sm90(qk_norm_rope_cache._qk_norm_rope_cache_kernel,
                 {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "qw_ptr": "*bf16",
                  "kw_ptr": "*bf16", "cache_ptr": "*fp32", "slot_ptr": "*i64", **caches},
                 dict(CLAMP=448.0 if cache == "fp8e4nv" else 57344.0, HEAD_DIM=128, HALF=64, BLOCK_HALF=64, PASS=0,
                      BLOCK_PASS=1, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=128, IS_NEOX=True, PDL=True, EARLY=True),
                 floats=("eps",), num_warps=4)
    compile_sm90(reshape_and_cache._reshape_and_cache_kernel,
                 {"key_ptr": "*bf16", "value_ptr": "*bf16", "slot_ptr": "*i64", **caches},
                 dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, FP8=True, CLAMP=448.0, PDL=True))
    return {"widened_in_ptx": "cvt.rn.f16x2.e" in decode, "byte_loads_from_shared": decode.count("ld.shared.b8"),
            "float8_dots_mma": float8_mma, "float8_v_loads": v_loads}


def pipelined_gemv() -> dict:
    """Load instructions in the pipelined FP8 GEMV's PTX (its first config), per scale form: the weight tiles go
    through cp.async into a ring of shared-memory buffers, which is what makes it stream faster than the skinny
    GEMVs."""
    block_n, block_k, stages, warps = fp8_gemv_pipelined.PIPELINED_CONFIGS[0]
    out = {}
    for form, per_channel, shared in (("channel", True, False), ("block", False, False), ("shared", False, True)):
        ptx = compile_sm90(fp8_gemv_pipelined._pipelined_gemv_kernel,
                           {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16"},
                           dict(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, PER_CHANNEL=per_channel,
                                SHARED_SCALES=shared, PDL=True, PREFETCH_LINES=16, LINE=128), num_warps=warps)
        out[form] = {"cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                     "ld_global": ptx.count("ld.global"), "prefetch_before_wait": _loads(ptx)["prefetch_before_wait"]}
    return out


def _loads(ptx: str) -> dict:
    """cp.async copies (all; of 16 bytes), the most commit groups left in flight by a wait, global loads."""
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return {"cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "cp_async_16B": len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x10", ptx)),
            "max_groups_in_flight": max(waits, default=0), "ld_global": ptx.count("ld.global"),
            "ld_global_v4": ptx.count("ld.global.v4"),
            # with PDL: L2 prefetches of the weights issued before the wait on the previous kernel
            "prefetch_before_wait": ptx.count("prefetch.global.L2", 0, max(ptx.find("griddepcontrol.wait"), 0))}


def _before_wait(ptx: str) -> dict:
    """Global loads and L2 prefetches a kernel issues before its wait on the previous kernel (griddepcontrol.wait)."""
    head = ptx[: max(ptx.find("griddepcontrol.wait"), 0)]
    return {"ld_global": head.count("ld.global"), "prefetch": head.count("prefetch.global.L2")}


def pdl_early() -> dict:
    """With and without `early_loads` (PDL): what the decode kernel, its merge, the q/k norm + rotary + cache write
    kernel and the MoE norm + router read (and, decode, prefetch) before waiting for the previous kernel; bf16 cache,
    Qwen3 heads, Qwen3-30B-A3B's router."""
    out = {}
    for early in (False, True):
        decode = compile_sm90(paged_decode._decode_kernel, {**_DECODE_POINTERS, "kc_ptr": "*bf16", "vc_ptr": "*bf16"},
                              dict(HEAD_DIM=128, BLOCK_D=128, HAS_SOFTCAP=False, HAS_WINDOW=False, HAS_SINKS=False,
                                   DOT_PRECISION="tf32", FP16_DOTS=False, WIDEN_ASM=0, G=4, BLOCK_G=16, BLOCK_N=64,
                                   IS_SPLIT=True, KEYS_MAJOR=False, F8_DOTS=False, EXACT_CAST=False, V_RUN=0, PDL=True,
                                   **_early("bf16", early)), num_warps=4, num_stages=2)
        merge = compile_sm90(paged_decode._reduce_kernel,
                             {"seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32",
                              "ml_ptr": "*fp32"},
                             dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=4, HAS_WINDOW=False, PDL=True, EARLY=early))
        rope = compile_sm90(qk_norm_rope_cache._qk_norm_rope_cache_kernel,
                            {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "qw_ptr": "*bf16",
                             "kw_ptr": "*bf16", "cache_ptr": "*fp32", "slot_ptr": "*i64", "kc_ptr": "*bf16",
                             "vc_ptr": "*bf16"},
                            dict(CLAMP=0.0, HEAD_DIM=128, HALF=64, BLOCK_HALF=64, PASS=0, BLOCK_PASS=1, BLOCK_HQ=32,
                                 BLOCK_HK=8, BLOCK_D=128, IS_NEOX=True, PDL=True, EARLY=early),
                            floats=("eps",), num_warps=4)
        router = compile_sm90(moe_norm_router._norm_router_kernel,
                              {**{n: "*bf16" for n in ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "normed_ptr", "res_out_ptr",
                                                       "logits_ptr")},
                               "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
                              dict(HIDDEN=2048, TOP_K=8, RENORMALIZE=True, SOFTMAX=True, BLOCK_SPLIT=1, BLOCK_H=2048,
                                   BLOCK_E=128, BLOCK_K=8, RANKED=True, ONE_SHOT=True, PDL=True, EARLY=early),
                              floats=("eps",), num_warps=1)
        out["early" if early else "late"] = {"decode": _before_wait(decode), "merge": _before_wait(merge),
                                             "qk_norm_rope_cache": _before_wait(rope),
                                             "norm_router": _before_wait(router)}
    return out


def skinny_pipelined_gemv() -> dict:
    """Load instructions in the PTX of the pipelined bf16 GEMV (every config of `PIPELINED_CONFIGS`, K a multiple
    of block_k or not) and of the skinny GEMV's first one-token config: the pipelined loop's weight tiles must be
    cp.async copies into shared memory, the skinny GEMV's plain (16-byte) register loads."""
    bf16 = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"}
    prologue_ptrs = {"res_ptr": "*bf16", "g_ptr": "*bf16", "res_out_ptr": "*bf16", "add_ptr": "*bf16"}
    out = {}
    plain = dict(NORM=False, HAS_RES=False, SILU_MUL=False, ADD_OUT=False)
    for block_n, block_k, stages, warps in skinny_gemv_pipelined.PIPELINED_CONFIGS:
        for even in (True, False):
            ptx = compile_sm90(skinny_gemv_pipelined._skinny_gemv_pipelined_kernel, {**bf16, **prologue_ptrs},
                               dict(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, HAS_BIAS=False, EVEN_K=even,
                                    PDL=True, PREFETCH_LINES=16, LINE=64, **plain), floats=("eps",), num_warps=warps)
            out[f"pipelined {block_n}/{block_k}/{stages}/{warps}" + ("" if even else " masked")] = _loads(ptx)
    block_n, block_k, stages, warps = skinny_gemv_pipelined.PIPELINED_CONFIGS[0]
    for name, flags in (("fused-norm", dict(NORM=True, HAS_RES=True, SILU_MUL=False, ADD_OUT=False)),
                        ("fused-silu", dict(NORM=False, HAS_RES=False, SILU_MUL=True, ADD_OUT=False)),
                        ("epilogue-add", dict(NORM=False, HAS_RES=False, SILU_MUL=False, ADD_OUT=True))):
        ptx = compile_sm90(skinny_gemv_pipelined._skinny_gemv_pipelined_kernel, {**bf16, **prologue_ptrs},
                           dict(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, HAS_BIAS=False, EVEN_K=True,
                                PDL=True, PREFETCH_LINES=16, LINE=64, **flags), floats=("eps",), num_warps=warps)
        out[f"{name} {block_n}/{block_k}/{stages}/{warps}"] = _loads(ptx)
    block_n, block_k, warps = skinny_gemv.CONFIGS[1][0]
    ptx = compile_sm90(skinny_gemv._skinny_gemv_kernel,
                       {**bf16, **prologue_ptrs, "ws_ptr": "*fp32", "cnt_ptr": "*i32"},
                       dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, **plain, HAS_BIAS=False, EVEN_K=True,
                            SPLIT_K=1, PDL=False, PREFETCH_LINES=16, LINE=64),
                       floats=("eps",), num_warps=warps)
    out[f"skinny {block_n}/{block_k}/{warps}"] = _loads(ptx)
    return out


def greedy_sampling() -> dict:
    """greedy_sample's slice kernel (bf16 and float32 logits) and its merge, compiled for sm90; their global loads
    and stores (the merge writes the token as int64 and (token, log-prob) as float64)."""
    out = {}
    for dtype in ("bf16", "fp32"):
        ptx = compile_sm90(greedy_sample._slice_kernel, {"x_ptr": f"*{dtype}", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                                                         "idx_ptr": "*i32"}, dict(CHUNK=greedy_sample.CHUNK), num_warps=4)
        out[f"slice {dtype}"] = _loads(ptx)
    ptx = compile_sm90(greedy_sample._merge_kernel, {"max_ptr": "*fp32", "sum_ptr": "*fp32", "idx_ptr": "*i32",
                                                     "tokens_ptr": "*i64", "packed_ptr": "*fp64"},
                       dict(BLOCK=128), num_warps=1)
    out["merge"] = dict(_loads(ptx), st_b64=len(re.findall(r"st\.global(?:\.\w+)*\.b64", ptx)))
    return out


if __name__ == "__main__":
    forms = {"fp8-gemv-pipelined": pipelined_gemv, "skinny-gemv-pipelined": skinny_pipelined_gemv, "pdl-early": pdl_early,
             "greedy-sample": greedy_sampling}
    print(json.dumps(forms[sys.argv[1]]() if sys.argv[1] in forms else main(sys.argv[1])))
