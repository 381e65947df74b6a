"""Fused MoE kernel timings at a bench config's expert shapes (GPU): `python -m fxrewrite.benchmarks.moe_kernels`.

For each token count T: the Triton `fused_experts` (the path it picks), its two paths forced
(``grouped``: align + two grouped GEMMs; ``direct``: the few-token GEMV kernels, T <= 16), the torch reference
(one matmul pair per hit expert) and, when transformers has them, its ``grouped_mm`` / ``batched_mm``
experts forwards on the same weights. Reported per row: milliseconds, the bytes of the experts
actually read (distinct experts hit x 3 * H * I * 2 bytes, bf16) over the time as GB/s and as a
fraction of the device's copy bandwidth (the roofline for decode), and TFLOP/s (2 * T * K * 3 * H * I).
Writes ``benchmarks/results/<date>-moe-kernels-<config>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from fxrewrite.benchmarks.common import RESULTS_DIR, environment, load_bench_config
from fxrewrite.benchmarks.kernels import _time_ms, copy_bandwidth
from fxrewrite.benchmarks.moe_direct_sweep import direct_sweep, graph_ms, short_context_decode_rows
from fxrewrite.benchmarks.out_paths import FOLDER_HELP, results_folder
from fxrewrite.kernels import fused_moe
from fxrewrite.kernels.fused_moe import fused_experts, fused_experts_ref, select_experts
from fxrewrite.kernels.fused_moe_direct import DIRECT_MAX_TOKENS, direct_experts
from fxrewrite.kernels.fused_moe_triton import gemm_config
from fxrewrite.kernels.moe_routing import moe_align_block_size, moe_align_block_size_ref, select_experts_ref

TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
GRAPH_ARMS = {"triton": fused_experts, "direct": direct_experts,
              "grouped": lambda *a: fused_moe._forward(*a, 0, save=False)[0]}
# --sweep candidates (block_m, block_n, block_k, num_warps, num_stages), by token-count range
SWEEP = {
    (1, 32): [(16, 32, 128, 4, 4), (16, 64, 64, 4, 5), (16, 64, 128, 4, 3), (16, 32, 256, 4, 2), (16, 128, 128, 4, 2)],
    (33, 256): [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 4, 2), (16, 128, 128, 4, 2),
                (64, 64, 64, 4, 3)],
    (257, 1 << 20): [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3),
                     (64, 128, 64, 8, 4)],
}


def _hf_forwards():
    """transformers' experts implementations that take (module, x, ids, weights), if installed."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return {}
    return {name: getattr(moe, f"{name}_experts_forward") for name in ("grouped_mm", "batched_mm")
            if hasattr(moe, f"{name}_experts_forward")}


class _Experts(torch.nn.Module):
    """The attributes transformers' experts forwards read (a Qwen3MoeExperts-shaped holder)."""

    def __init__(self, w13, w2):
        super().__init__()
        self.gate_up_proj, self.down_proj = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
        self.num_experts = w13.shape[0]
        self.act_fn = torch.nn.SiLU()
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _routing_arms(logits, k, e) -> dict:
    """select_experts + moe_align_block_size: the Triton kernels and the torch references."""
    block = gemm_config(logits.shape[0])["block_m"]
    return {"routing_triton": lambda: moe_align_block_size(select_experts(logits, k, True)[1], block, e),
            "routing_torch": lambda: moe_align_block_size_ref(select_experts_ref(logits, k, True)[1], block, e)}


def sweep(x, w13, w2, weights, ids) -> list[dict]:
    """Time fused_experts under each candidate tile config for this token count; fastest first."""
    t = x.shape[0]
    cands = next(c for (lo, hi), c in SWEEP.items() if lo <= t <= hi)
    rows = []
    for bm, bn, bk, nw, ns in cands:
        cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        original = fused_moe.gemm_config
        fused_moe.gemm_config = lambda _t, cfg=cfg: cfg
        try:
            grouped = GRAPH_ARMS["grouped"]  # the grouped GEMMs even where fused_experts would go direct
            rows.append(dict(tokens=t, arm="sweep", config=cfg, ms=_time_ms(lambda: grouped(x, w13, w2, weights, ids))))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit shared memory
            rows.append(dict(tokens=t, arm="sweep", config=cfg, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        finally:
            fused_moe.gemm_config = original
    rows.sort(key=lambda r: r.get("ms", float("inf")))
    for r in rows:
        print(f"T={t:5d} sweep {r['config']} {r.get('ms', r.get('error'))}", flush=True)
    return rows


def _arms(x, w13, w2, weights, ids, module, direct_only: bool) -> dict:
    """The timed forms for this token count (`direct_only`: the direct path and the routing kernels)."""
    t, (e, k) = x.shape[0], (w13.shape[0], ids.shape[1])
    arms = {} if direct_only else {"triton": lambda: fused_experts(x, w13, w2, weights, ids),
                                   "grouped": lambda: fused_moe._forward(x, w13, w2, weights, ids, 0, save=False)[0],
                                   "torch_ref": lambda: fused_experts_ref(x, w13, w2, weights, ids)}
    if t <= DIRECT_MAX_TOKENS:
        arms["direct"] = lambda: direct_experts(x, w13, w2, weights, ids)
    if not direct_only:
        arms |= {f"hf_{n}": (lambda f=f: f(module, x, ids, weights.to(x.dtype))) for n, f in _hf_forwards().items()}
    return arms | _routing_arms(torch.randn(t, e, device=x.device, dtype=x.dtype), k, e)


def run(config: str, out_dir: Path, do_sweep: bool = False, tokens: tuple[int, ...] = TOKENS,
        direct_only: bool = False) -> dict:
    cfg = load_bench_config(config)["config"]
    e, k, h, i = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=dt) * 0.02
    module, bw, rows = _Experts(w13, w2), copy_bandwidth(), []
    layers = [(w13, w2)] + [(torch.randn_like(w13) * 0.02, torch.randn_like(w2) * 0.02) for _ in range(3)]
    for t in tokens:
        x = torch.randn(t, h, device=dev, dtype=dt)
        weights, ids = select_experts(torch.randn(t, e, device=dev), k, True)
        hit = int(ids.unique().numel())
        nbytes, flops = hit * 3 * h * i * 2 + 2 * x.numel() * 2, 2 * t * k * 3 * h * i
        arms = _arms(x, w13, w2, weights, ids, module, direct_only)
        with torch.no_grad():
            if do_sweep:
                rows += [] if direct_only else sweep(x, w13, w2, weights, ids)
                rows += direct_sweep(x, layers, weights, ids) if t <= DIRECT_MAX_TOKENS else []
            for name, fn in arms.items():
                try:
                    ms = _time_ms(fn)
                except Exception as exc:  # noqa: BLE001 - an arm transformers lacks on this version
                    rows.append(dict(tokens=t, arm=name, error=f"{type(exc).__name__}: {exc}"))
                    continue
                if name.startswith("routing"):
                    rows.append(dict(tokens=t, arm=name, ms=ms))
                    print(f"T={t:5d} {name:14s} {ms:8.3f} ms", flush=True)
                    continue
                rows.append(dict(tokens=t, arm=name, ms=ms, experts_hit=hit, GBps=nbytes / ms / 1e6,
                                 pct_of_copy=100 * nbytes / (ms * 1e-3) / bw, tflops=flops / ms / 1e9))
                if t <= 16 and name in GRAPH_ARMS:  # launch-bound sizes: the GPU time in a graph
                    g = graph_ms(lambda a, b, name=name: GRAPH_ARMS[name](x, a, b, weights, ids), layers)
                    rows[-1].update(graph_ms=g, graph_pct_of_copy=100 * nbytes / (g * 1e-3) / bw)
                    print(f"T={t:5d} {name:14s} graph {g * 1e3:8.1f} us  {rows[-1]['graph_pct_of_copy']:5.1f}% of copy",
                          flush=True)
                print(f"T={t:5d} {name:14s} {ms:8.3f} ms  {rows[-1]['pct_of_copy']:5.1f}% of copy  "
                      f"{rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
    if do_sweep and direct_only:  # the rest of a few-token step's attention: short contexts in long graphs
        q_heads = cfg["num_attention_heads"]
        heads = (q_heads, cfg["num_key_value_heads"], cfg.get("head_dim") or h // q_heads)
        rows += short_context_decode_rows(heads)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(meta=dict(date=now.isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                            config=config, torch=torch.__version__, copy_GBps=bw / 1e9),
                  gemm_configs={t: gemm_config(t) for t in tokens}, rows=rows,
                  environment=environment())  # versions (transformers, triton) and fxrewrite's commit
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-direct" if direct_only else ""
    (out_dir / f"{now:%Y-%m-%d}-moe-kernels-{Path(config).stem}{suffix}.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxrewrite.benchmarks.moe_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-30b-a3b")
    p.add_argument("--out", type=results_folder, default=RESULTS_DIR, help=FOLDER_HELP)
    p.add_argument("--tokens", type=lambda v: tuple(int(t) for t in v.split(",")), default=TOKENS,
                   help="comma-separated token counts (default %(default)s)")
    p.add_argument("--sweep", action="store_true", help="also time candidate tile configs per token count (grouped "
                   "GEMM; direct kernels and router alone in CUDA graphs)")
    p.add_argument("--direct-only", action="store_true", help="only the few-token path: the direct kernels and "
                   "routing (with --sweep: their tile sweep, < 60 s; writes ...-moe-kernels-<config>-direct.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernels needs a CUDA GPU")
    run(args.config, args.out, args.sweep, args.tokens, args.direct_only)
    return 0


if __name__ == "__main__":
    from fxrewrite.benchmarks.tool_cli import run_cli

    raise SystemExit(run_cli(main))
