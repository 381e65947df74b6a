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

An optimizer built before ``optimize`` holds the Parameters the fused layers replaced (q/k/v, gate/up, the norms'
weights): its steps would update tensors the model no longer uses and leave the model's own untrained, silently.
Its first step raises instead, naming a replaced parameter and the fix (build the optimizer after ``optimize``;
`fxrewrite.optimizer_state` converts a saved state).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["PER_TENSOR_OPTIMIZERS", "track", "watch"]

PER_TENSOR_OPTIMIZERS = frozenset({
    "Adafactor", "Muon", "Lamb", "LAMB", "Lars", "LARS", "Shampoo", "SOAP", "PSGD", "GaLore", "APOLLO", "AdamMini",
    "Adam_mini", "Dion", "Lomo", "LOMO",
})
"""Parts of class names (of a class or any base: ``FusedLAMB``, ``ForeachSOAP``, ``GaLoreAdamW8bit``...) of
optimizers whose update reads a tensor as a whole."""

_MERGED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # merged Parameter -> "qkv_proj.weight (q_proj, k_proj, v_proj)"
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a Parameter optimize replaced (still alive) -> its name
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizers already looked at
_HOOK = []


def watch(model: nn.Module) -> WeakIdKeyDictionary:
    """{Parameter: name} of `model` before ``optimize`` (weak: a replaced one nothing else holds is freed)."""
    return WeakIdKeyDictionary({param: name for name, param in model.named_parameters()})


def track(model: nn.Module, shards_attr: str, watched: WeakIdKeyDictionary) -> None:
    """Remember `model`'s merged parameters (modules' ``shards_attr`` lists: [(new child, [(old child, id)...])])
    and those of `watched` it no longer has, and install the optimizer step pre-hook (once per process)."""
    current = {id(param) for param in model.parameters()}
    for param, name in list(watched.items()):
        if id(param) not in current:
            _REPLACED[param] = name
    for prefix, module in model.named_modules():
        for new, olds in module.__dict__.get(shards_attr, ()):
            child = module.get_submodule(new)
            for pname, param in child.named_parameters(recurse=False):
                parts = ", ".join(old for old, _ in olds)
                _MERGED[param] = f"{prefix + '.' if prefix else ''}{new}.{pname} ({parts})"
    if (_MERGED or _REPLACED) and not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    stale = [_REPLACED[p] for group in optimizer.param_groups for p in group["params"] if p in _REPLACED]
    if stale:  # every step raises (not marked checked)
        raise RuntimeError(f"this {type(optimizer).__name__} holds {len(stale)} parameter(s) that fxrewrite.optimize "
                           f"replaced with fused layers' own (e.g. {stale[0]}): its steps would not train the model. "
                           "Build the optimizer after fxrewrite.optimize(model) (fxrewrite.optimizer_state converts a "
                           "saved optimizer state)")
    _CHECKED[optimizer] = True
    kind = next((k.__name__ for k in type(optimizer).__mro__ if any(t in k.__name__ for t in PER_TENSOR_OPTIMIZERS)),
                None)
    if kind is None:
        return
    merged = [_MERGED[p] for group in optimizer.param_groups for p in group["params"] if p in _MERGED]
    if merged:
        shown = "; ".join(merged[:3]) + (f"; and {len(merged) - 3} more" if len(merged) > 3 else "")
        warnings.warn(f"{kind} updates each parameter as a whole, and fxrewrite.optimize merged {len(merged)} of "
                      f"this optimizer's parameters ({shown}): its steps differ from the stock model's (the "
                      "gradients do not). fxrewrite.optimize(model, merge_weights=False) keeps them separate.",
                      UserWarning, stacklevel=3)
