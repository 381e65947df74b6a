"""Graph breaks of ``torch.compile(fxrewrite.optimize(model))`` in training, read from dynamo's counters: the two the
deferred LM-head gradient intends (fxrewrite.layers.deferred_head_grad) and nothing else."""

from __future__ import annotations

from torch._dynamo.utils import counters

from fxrewrite.layers.deferred_head_grad import ATTACH_BREAK
from fxrewrite.layers.lm_head_loss import LOSS_BREAK

# dynamo counts a break once per frame it unwinds, and transformers' modeling code sets how many frames there are:
# (embedding hook, loss) by transformers version, as counted (5.17: torch 2.11 and 2.13; 5.24: torch 2.13)
DEFERRAL_BREAKS = {"5.17": (4, 2), "5.24": (6, 2)}


def graph_breaks() -> dict[str, int]:
    """{"attach": n, "loss": n, <any other reason>: n} since ``counters.clear()``, zero counts left out."""
    found: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = "attach" if ATTACH_BREAK in reason else "loss" if LOSS_BREAK in reason else reason
        found[key] = found.get(key, 0) + n
    return found


def assert_deferral_breaks() -> None:
    """Exactly the deferral's two breaks, each as often as dynamo counts it under this transformers (where known)."""
    import transformers

    found = graph_breaks()
    assert set(found) == {"attach", "loss"}, found
    want = DEFERRAL_BREAKS.get(".".join(transformers.__version__.split(".")[:2]))
    if want is not None:
        assert (found["attach"], found["loss"]) == want, (found, want)
