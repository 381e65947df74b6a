"""Parameters that `optimize` merged (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), and a warning for the
optimizers whose update such a merge changes.

Gradients of a merged parameter are exactly the stock model's, stacked; an optimizer that works element by element
(SGD, Adam, AdamW and the rest of ``torch.optim`` except those below) therefore trains exactly as on the stock model.
One whose update depends on each tensor as a whole does not: Adafactor factors a matrix's second moment into row
and column means and clips each tensor's update by its RMS (Shazeer & Stern, 2018), Muon orthogonalises each matrix
(Jordan et al., 2024), LAMB/LARS scale by each tensor's norm ratio, Shampoo/SOAP precondition per matrix, GaLore
projects each matrix's gradient. On a merged parameter these see one [q+k+v, hidden] matrix instead of three.
The first step of such an optimizer over a merged parameter warns once, naming the parameters and the fix
(``fxrewrite.optimize(model, merge_weights=False)`` keeps them apart: the other fusions stay).
"""

from __future__ import annotations

import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["PER_TENSOR_OPTIMIZERS", "track"]

PER_TENSOR_OPTIMIZERS = frozenset({
    "Adafactor", "Muon", "Lamb", "LAMB", "FusedLAMB", "Lars", "LARS", "Shampoo", "DistributedShampoo", "SOAP",
    "GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreAdafactor", "APOLLOAdamW", "AdamMini", "Adam_mini", "Dion",
})
"""Class names (a class or any base) of optimizers whose update reads a tensor as a whole."""

_MERGED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # merged Parameter -> "qkv_proj.weight (q_proj, k_proj, v_proj)"
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizers already looked at
_HOOK = []


def track(model: nn.Module, shards_attr: str) -> None:
    """Remember `model`'s merged parameters (modules' ``shards_attr`` lists: [(new child, [(old child, id)...])])
    and install the optimizer step pre-hook (once per process)."""
    for prefix, module in model.named_modules():
        for new, olds in module.__dict__.get(shards_attr, ()):
            child = module.get_submodule(new)
            for pname, param in child.named_parameters(recurse=False):
                parts = ", ".join(old for old, _ in olds)
                _MERGED[param] = f"{prefix + '.' if prefix else ''}{new}.{pname} ({parts})"
    if _MERGED and not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED[optimizer] = True
    kind = next((k.__name__ for k in type(optimizer).__mro__ if k.__name__ in PER_TENSOR_OPTIMIZERS), None)
    if kind is None:
        return
    merged = [_MERGED[p] for group in optimizer.param_groups for p in group["params"] if p in _MERGED]
    if merged:
        shown = "; ".join(merged[:3]) + (f"; and {len(merged) - 3} more" if len(merged) > 3 else "")
        warnings.warn(f"{kind} updates each parameter as a whole, and fxrewrite.optimize merged {len(merged)} of "
                      f"this optimizer's parameters ({shown}): its steps differ from the stock model's (the "
                      "gradients do not). fxrewrite.optimize(model, merge_weights=False) keeps them separate.",
                      UserWarning, stacklevel=3)
