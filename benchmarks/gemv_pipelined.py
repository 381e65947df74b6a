"""Experiment: a software-pipelined one-token GEMV (weight tiles staged through shared memory, several in flight)
against the skinny GEMV and cuBLAS, at Qwen3-4B / Qwen3-32B decode shapes, bf16 and FP8 per-channel weights.

`python -m fxrewrite.benchmarks.gemv_pipelined --out DIR` (GPU). The skinny GEMV
(`fxrewrite.kernels.skinny_gemv`) loads each [BLOCK_N, BLOCK_K] weight tile straight into registers with one
tile per program in flight (no cp.async / TMA in its sm90 PTX); at the small Qwen3-4B matrices it streams
2.5-3.1 TB/s. The variants here keep NUM_STAGES tiles in flight per program:

- ``ptr``: `tl.load` in a `tl.range(..., num_stages=S)` loop (triton lowers it to cp.async into a ring of
  shared-memory buffers);
- ``tma``: a host tensor descriptor (`triton.tools.tensor_descriptor.TensorDescriptor`), whose loads in the
  same loop become TMA bulk copies (`cp.async.bulk.tensor`) completing on mbarriers.

Both multiply the tile by x elementwise into a float32 [BLOCK_N, BLOCK_K] accumulator reduced once after the
loop (as the skinny GEMV does); FP8 per-channel weights are widened in registers and the row scale multiplies the
reduced sum. The float rows also time the package's pipelined GEMV (``pipelined:``,
`fxrewrite.kernels.skinny_gemv_pipelined`, the load-time tuner's candidates). Every timing is a CUDA graph of
20 calls cycling over enough weight copies to overflow L2 (`benchmarks.gemv.graph_us`); every variant is
first checked against F.linear on the dequantized weight.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.benchmarks.common import RESULTS_DIR, environment, write_result
from fxrewrite.benchmarks.gemv import _timed, copy_tbps
from fxrewrite.benchmarks.tool_cli import require_cuda
from fxrewrite.kernels import fp8_dispatch
from fxrewrite.kernels.gemv_dispatch import is_pipelined
from fxrewrite.kernels.gemv_tune import (TOLERANCE, candidate, candidates, max_rel_error, scratch_scales,
                                         scratch_weights)
from fxrewrite.kernels.triton_utils import tl, triton

SHAPES = {  # (N, K) per projection, TP 1
    "qwen3-4b": {"qkv_proj": (6144, 2560), "o_proj": (2560, 4096), "gate_up_proj": (19456, 2560),
                 "down_proj": (2560, 9728)},
    "qwen3-32b": {"qkv_proj": (10240, 5120), "o_proj": (5120, 8192), "gate_up_proj": (51200, 5120),
                  "down_proj": (5120, 25600)},
}


@triton.jit
def _gemv_tma_kernel(w_desc, x_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, HAS_SCALE: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k0])
        x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    rn = n0 + tl.arange(0, BLOCK_N)
    total = tl.sum(acc, 1)
    if HAS_SCALE:
        total *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemv_ptr_kernel(w_ptr, x_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, HAS_SCALE: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(rows + (k0 + rk)[None, :], mask=(k0 + rk < K)[None, :], other=0.0)
        x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    total = tl.sum(acc, 1)
    if HAS_SCALE:
        total *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=rn < N)


def gemv(variant: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, config: tuple[int, ...],
         descs: dict | None = None) -> torch.Tensor:
    """x [1, K] bf16, w [N, K] bf16 or fp8 (scale [N] float32 per row) -> [1, N] bf16."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_k, stages, warps = config
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    common = dict(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, HAS_SCALE=scale is not None, num_warps=warps)
    s = scale if scale is not None else out
    if variant == "tma":
        key = (w.data_ptr(), block_n, block_k)
        desc = descs.get(key) if descs is not None else None
        if desc is None:
            desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
            if descs is not None:
                descs[key] = desc
        _gemv_tma_kernel[grid](desc, x, s, out, n, k, **common)
    else:
        _gemv_ptr_kernel[grid](w, x, s, out, n, k, **common)
    return out


def configs(fp8: bool) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, num_stages, num_warps): 256-512 bytes of each row per tile."""
    ks = (256, 512) if fp8 else (128, 256)
    return [(bn, bk, st, wp) for bn in (4, 8, 16) for bk in ks for st in (3, 5) for wp in (4,)]


def measure(n: int, k: int, fp8: bool) -> dict:
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    ws = scratch_weights(n, k, "cuda", dtype)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    scale2 = scratch_scales(n, k, "cuda", per_channel=True) if fp8 else None
    scale = scale2[:, 0].contiguous() if fp8 else None
    want = F.linear(x.float(), ws[0].float() * (scale[:, None] if fp8 else 1))
    arms: dict = {}
    if fp8:
        arms["fp8_gemm"] = _timed(lambda i: fp8_dispatch.fp8_linear_dispatch(x, ws[i], scale2, per_channel=True),
                                  len(ws))
    else:
        arms["cublas"] = _timed(lambda i: F.linear(x, ws[i]), len(ws))
    fmt = "fp8-channel" if fp8 else "float"
    fp8_args = {"w_scale": scale2, "per_channel": True} if fp8 else {}
    for config in candidates(1, "linear", n, fmt):  # float: + the kernel's own pipelined GEMV ("pipelined:")
        name = "skinny:" + "/".join(map(str, config))
        if is_pipelined(config):
            name = "pipelined:" + "/".join(map(str, config[1:]))
        arms[name] = _timed(lambda i, c=config: candidate("linear", ws[i], x=x, config=c, **fp8_args), len(ws))
    descs: dict = {}
    for variant in ("ptr", "tma"):
        for config in configs(fp8):
            name = f"{variant}:" + "/".join(map(str, config))
            try:
                err = max_rel_error(gemv(variant, x, ws[0], scale, config, descs), want)
            except Exception as e:  # noqa: BLE001 - a config this GPU / triton cannot build is reported
                arms[name] = f"error: {type(e).__name__}: {str(e)[:160]}"
                continue
            arms[name] = _timed(lambda i, c=config, v=variant: gemv(v, x, ws[i], scale, c, descs), len(ws)) \
                if err < TOLERANCE else f"error: max relative error {err:.3g}"
    nbytes = n * k * ws[0].element_size()
    timed = {a: t for a, t in arms.items() if isinstance(t, float)}
    best = {p: min((a for a in timed if a.startswith(p)), key=timed.get, default=None)
            for p in ("skinny", "pipelined", "ptr", "tma")}
    return {"N": n, "K": k, "format": fmt, "weight_bytes": nbytes, "us": arms,
            "TBps": {a: round(nbytes / (t * 1e-6) / 1e12, 3) for a, t in timed.items()},
            "best": {p: (a, round(timed[a], 2)) for p, a in best.items() if a}}


def ptx_stats() -> dict:
    """How triton lowered the two loops on this machine (cp.async / TMA counts in the PTX of the last builds)."""
    out = {}
    for name, kernel in (("ptr", _gemv_ptr_kernel), ("tma", _gemv_tma_kernel)):
        for dev_cache in kernel.device_caches.values():
            for compiled in list(dev_cache[0].values())[:1]:
                ptx = compiled.asm["ptx"]
                out[name] = {"cp.async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                             "cp.async.bulk.tensor": ptx.count("cp.async.bulk.tensor"),
                             "mbarrier": ptx.count("mbarrier"), "ld.global": ptx.count("ld.global"),
                             "shared_bytes": compiled.metadata.shared}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.gemv_pipelined",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="qwen3-4b,qwen3-32b")
    parser.add_argument("--formats", default="float,fp8-channel")
    parser.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    args = parser.parse_args(argv)
    require_cuda("gemv_pipelined")
    date = datetime.date.today().isoformat()
    result = {"date": date, "environment": environment(), "copy_TBps": round(copy_tbps(), 3), "rows": {}}
    for cfg in args.configs.split(","):
        for fmt in args.formats.split(","):
            for proj, (n, k) in SHAPES[cfg].items():
                row = measure(n, k, fmt != "float")
                result["rows"][f"{cfg} {proj} {fmt}"] = row
                print(f"{cfg} {proj:13s} {fmt:11s} " + "  ".join(f"{p} {a} {t}us" for p, (a, t) in row["best"].items()
                                                              ), flush=True)
    result["ptx"] = ptx_stats()
    print(json.dumps(result["ptx"]))
    write_result(Path(args.out) / f"{date}-gemv-pipelined.json", result)
    return result


if __name__ == "__main__":
    main()
