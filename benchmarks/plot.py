"""Bar chart of a compare result: one bar per arm, the workload's headline figure."""

from __future__ import annotations

import sys
from pathlib import Path

from fxrewrite.benchmarks.common import device_label

# workload kind -> (figure key inside an arm's result, axis label)
HEADLINES = {
    "throughput": ("output_tokens_per_s", "output tokens/s"),
    "latency": ("batch_1.decode_tokens_per_s", "batch-1 decode tokens/s"),
    "long": ("decode_tokens_per_s", "decode tokens/s at the longest prompt"),
}


def arm_failed(arm_result: dict) -> bool:
    """An arm that raised, or whose requests all failed (transformers' generate_batch reports errors
    per request and returns empty outputs)."""
    return "error" in arm_result or (bool(arm_result.get("errors")) and not arm_result.get("output_tokens"))


def headline(arm_result: dict, kind: str) -> float | None:
    """The arm's headline number (None when the arm failed or lacks it)."""
    if arm_failed(arm_result):
        return None
    value = arm_result
    for part in arm_result.get("headline_key", HEADLINES[kind][0]).split("."):  # a run may name its own
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value if isinstance(value, (int, float)) else None


def plot_result(result: dict, path: Path) -> Path | None:
    """Write a PNG bar chart of `result` (compare's JSON dict) to `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] no PNG: matplotlib is not installed (pip install 'fxrewrite[bench]')", file=sys.stderr)
        return None
    kind = result["workload"]["kind"]
    arms = [(arm, headline(r, kind)) for arm, r in result["arms"].items()]
    arms = [(arm, v) for arm, v in arms if v is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([a for a, _ in arms], [v for _, v in arms], color="#4C72B0")
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel(HEADLINES[kind][1])
    env = result["environment"]
    ax.set_title(f"{result['config']} {kind} - {device_label(env)}\n{env['date'][:10]}, torch {env['torch']}, "
                 f"transformers {env['transformers']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
