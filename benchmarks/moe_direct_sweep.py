"""Tile sweep of the few-token MoE kernels (GPU), each kernel timed alone in CUDA graphs.

Run through ``python -m fxrewrite.benchmarks.moe_kernels --config qwen3-30b-a3b --tokens 1,2,4,8 --sweep``
(about 30 s on an H200: each candidate compiles once, then one graph per kernel and config replays).
Per token count T it times `direct_gate_up` and `direct_down` (`fxrewrite.kernels.fused_moe_direct`)
under each tile candidate, and the router as one fused launch (`route_experts`) at each launch shape the
load-time tuner chooses from, against the GEMM + `select_experts` pair. A graph calls the kernel on several layers' weights in turn, so no call
finds its weights in L2 (as in a decode step). Reported: GPU microseconds per call and the TB/s of
routed bytes (the distinct experts hit x that kernel's weight bytes; the router: its whole weight),
the quantity the batch-1 decode roofline counts. `short_context_decode_rows` times batch-1 decode
attention as a graph captured for a long context replays it (16 splits), with and without the
one-program walk of short contexts (`paged_decode`'s ``single_split_len``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxrewrite.benchmarks.common import replay_ms
from fxrewrite.benchmarks.kernels import _paged_batch
from fxrewrite.kernels.fused_moe_direct import direct_config, direct_down, direct_gate_up
from fxrewrite.kernels.moe_router import ROUTER_CONFIGS, route_experts
from fxrewrite.kernels.moe_routing import select_experts
from fxrewrite.kernels.paged_decode import _num_splits, paged_decode_triton

__all__ = ["GATE_UP_TILES", "DOWN_TILES", "graph_ms", "direct_sweep", "short_context_decode_rows"]

# (block_n, block_k, num_warps) candidates; the first of each is `direct_config`'s choice
# (ptxas sm_90a: none of these spills, except the earlier gate_up default (16, 256, 4), kept for comparison)
GATE_UP_TILES = [(4, 512, 8), (16, 256, 4), (4, 256, 4), (4, 256, 8), (2, 512, 4), (2, 256, 4), (8, 512, 8),
                 (8, 256, 8)]
DOWN_TILES = [(2, 256, 4), (1, 256, 4), (2, 256, 8), (1, 512, 4), (2, 512, 8), (4, 256, 8), (2, 128, 4),
              (1, 256, 2)]


def graph_ms(fn, layers, reps: int = 20) -> float:
    """GPU milliseconds of ``fn(*layer)`` per call, as a decode step's CUDA graph runs it: one graph calls
    it on each layer in turn (together more bytes than L2 holds), replayed `reps` times after a warm-up."""
    for layer in layers:
        fn(*layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            fn(*layer)
    return replay_ms(graph, reps) / len(layers)


def _row(t, arm, tile, ms, nbytes) -> dict:
    cfg = dict(block_n=tile[0], block_k=tile[1], num_warps=tile[2]) if tile else None
    return dict(tokens=t, arm=arm, config=cfg, us=ms * 1e3, routed_bytes=nbytes, TBps=nbytes / (ms * 1e-3) / 1e12)


def _kernel_rows(x, layers, weights, ids, hit) -> list[dict]:
    t, k = ids.shape
    e, two_i, h = layers[0][0].shape
    flat_ids, flat_w = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    acts = [direct_gate_up(x, w13, flat_ids, k, 0, direct_config(t)["gate_up"]) for w13, _ in layers]
    out = torch.empty_like(x)
    rows = []
    for tile in GATE_UP_TILES:
        cfg = dict(block_n=tile[0], block_k=tile[1], num_warps=tile[2])
        ms = graph_ms(lambda w13, _w2, _a, cfg=cfg: direct_gate_up(x, w13, flat_ids, k, 0, cfg),
                      [(w13, w2, a) for (w13, w2), a in zip(layers, acts)])
        rows.append(_row(t, "direct_gate_up", tile, ms, hit * two_i * h * 2))
    for tile in DOWN_TILES:
        cfg = dict(block_n=tile[0], block_k=tile[1], num_warps=tile[2])
        ms = graph_ms(lambda _w13, w2, a, cfg=cfg: direct_down(a, w2, flat_ids, flat_w, out, k, 0, cfg),
                      [(w13, w2, a) for (w13, w2), a in zip(layers, acts)])
        rows.append(_row(t, "direct_down", tile, ms, hit * h * (two_i // 2) * 2))
    return rows


def _router_rows(x, num_experts, top_k) -> list[dict]:
    """The router at each `ROUTER_CONFIGS` launch shape (arm "router_fused", config named) and as the GEMM +
    `select_experts` pair ("router_gemm_select"), over 64 gate copies (32 MB: the step's other weights
    evict the gate between layers; here the copies stand in for them)."""
    gates = [(torch.randn(num_experts, x.shape[1], device=x.device, dtype=x.dtype) * 0.02,) for _ in range(64)]
    nbytes = gates[0][0].numel() * gates[0][0].element_size()
    rows = []
    for cfg in ROUTER_CONFIGS:
        ms = graph_ms(lambda w, cfg=cfg: route_experts(x, w, top_k, True, config=cfg), gates)
        row = _row(x.shape[0], "router_fused", None, ms, nbytes)
        rows.append({**row, "config": cfg._asdict()})
    gemm = graph_ms(lambda w: select_experts(F.linear(x, w), top_k, True), gates)
    return rows + [_row(x.shape[0], "router_gemm_select", None, gemm, nbytes)]


def direct_sweep(x, layers, weights, ids) -> list[dict]:
    """Rows for token count x.shape[0]: each tile candidate of both direct kernels, and the two router
    forms; prints the fastest tile of each kernel (a line without the word "sweep", for terse logs)."""
    hit = int(ids.unique().numel())
    rows = _kernel_rows(x, layers, weights, ids, hit) + _router_rows(x, layers[0][0].shape[0], ids.shape[1])
    for arm in ("direct_gate_up", "direct_down"):
        best = min((r for r in rows if r["arm"] == arm), key=lambda r: r["us"])
        default = next(r for r in rows if r["arm"] == arm)
        print(f"T={x.shape[0]:3d} {arm:15s} best {best['config']} {best['us']:6.1f} us {best['TBps']:5.2f} TB/s "
              f"(default {default['us']:6.1f} us {default['TBps']:5.2f} TB/s)", flush=True)
    for r in rows:
        if r["arm"].startswith("router"):
            cfg = "/".join(str(int(v)) for v in r["config"].values()) if r["config"] else "F.linear + top-k"
            print(f"T={x.shape[0]:3d} {r['arm']:18s} {cfg:16s} {r['us']:6.1f} us", flush=True)
    return rows


def short_context_decode_rows(heads: tuple[int, int, int], max_model_len: int = 4096,
                              contexts: tuple[int, ...] = (128, 256, 384, 512, 768)) -> list[dict]:
    """Batch-1 decode attention (heads: Hq, Hkv, D) in graphs whose split count is max_model_len's:
    microseconds per layer with ``single_split_len`` 0 (always split, then merge) and the default."""
    num_heads, num_kv_heads, head_dim = heads
    splits, rows = _num_splits(1, num_kv_heads, max_model_len), []
    for ctx in contexts:
        layers = [_paged_batch([(ctx - 1, 1)], num_heads, num_kv_heads, head_dim)[0] for _ in range(8)]
        timed = {}
        for name, single in (("split_merge", 0), ("short_single", None)):
            kw = {} if single is None else {"single_split_len": single}
            timed[name] = graph_ms(lambda *a, kw=kw: paged_decode_triton(*a[:7], max_model_len, head_dim ** -0.5,
                                                                          num_splits=splits, **kw), layers) * 1e3
        rows.append(dict(tokens=1, arm="decode_attention", context=ctx, splits=splits, **{f"{k}_us": v
                                                                                         for k, v in timed.items()}))
        print(f"decode attention b1 ctx {ctx:4d} ({splits} splits): split+merge {timed['split_merge']:5.1f} us, "
              f"short path {timed['short_single']:5.1f} us", flush=True)
    return rows
