"""Fused MoE kernel timings at a bench config's expert shapes (GPU): `python -m fxrewrite.benchmarks.moe_kernels`.

For each token count T: the Triton `fused_experts` (align + two grouped GEMMs), the torch reference
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

from fxrewrite.benchmarks.common import RESULTS_DIR, load_bench_config
from fxrewrite.benchmarks.kernels import _time_ms, copy_bandwidth
from fxrewrite.kernels.fused_moe import fused_experts, fused_experts_ref, select_experts

TOKENS = (1, 8, 64, 256, 1024, 4096)


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


def run(config: str, out_dir: Path) -> dict:
    cfg = load_bench_config(config)["config"]
    e, k, h, i = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=dt) * 0.02
    module, bw, rows = _Experts(w13, w2), copy_bandwidth(), []
    for t in TOKENS:
        x = torch.randn(t, h, device=dev, dtype=dt)
        weights, ids = select_experts(torch.randn(t, e, device=dev), k, True)
        hit = int(ids.unique().numel())
        nbytes, flops = hit * 3 * h * i * 2 + 2 * x.numel() * 2, 2 * t * k * 3 * h * i
        arms = {"triton": lambda: fused_experts(x, w13, w2, weights, ids),
                "torch_ref": lambda: fused_experts_ref(x, w13, w2, weights, ids)}
        arms |= {f"hf_{n}": (lambda f=f: f(module, x, ids, weights.to(dt))) for n, f in _hf_forwards().items()}
        with torch.no_grad():
            for name, fn in arms.items():
                try:
                    ms = _time_ms(fn)
                except Exception as exc:  # noqa: BLE001 - an arm transformers lacks on this version
                    rows.append(dict(tokens=t, arm=name, error=f"{type(exc).__name__}: {exc}"))
                    continue
                rows.append(dict(tokens=t, arm=name, ms=ms, experts_hit=hit, GBps=nbytes / ms / 1e6,
                                 pct_of_copy=100 * nbytes / (ms * 1e-3) / bw, tflops=flops / ms / 1e9))
                print(f"T={t:5d} {name:14s} {ms:8.3f} ms  {rows[-1]['pct_of_copy']:5.1f}% of copy  "
                      f"{rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(meta=dict(date=now.isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                            config=config, torch=torch.__version__, copy_GBps=bw / 1e9), rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{now:%Y-%m-%d}-moe-kernels-{Path(config).stem}.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-30b-a3b")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernels needs a CUDA GPU")
    run(args.config, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
