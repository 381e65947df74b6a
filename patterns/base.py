"""The pattern contract: match -> rewrite -> build (+ validate, describe, shards).

A pattern is a class with classmethods only; the compiler (`fxrewrite.compiler`) drives it:

1. ``match(traced, ctx) -> list[Match]`` runs once per group of identical instances of a module class
   (`fxrewrite.signature`) on the traced graph of the group's first instance (`fxrewrite.tracer.Traced`). It finds the pattern by dataflow only (which
   node reads which), never by class or attribute names. A `Match` holds *names* (child
   attribute names, fx node names, the name of an attribute holding eps) and facts that hold for
   the whole class (an activation kind, an offset): never modules or per-instance numbers, which
   `build` reads from each instance. A near miss (the shape is there, but something cannot be
   proved, e.g. q/k/v disagree on bias) raises `Refusal` with the reason; no shape at all
   returns []. ``Match.claimed`` lists the fx nodes the match owns: the compiler checks that no
   node is claimed twice, so patterns stay disjoint by construction.
2. ``rewrite(match, src, tree) -> tree`` (scope "forward") edits the class's `forward` source,
   a libcst tree (`fxrewrite.source`), and returns the new tree. It raises `Refusal` (or
   `fxrewrite.source.SourceError`) when the edit cannot be proved safe from the source alone
   (a call appears twice, an input is reassigned in between, a temporary would shadow a name).
   Module-scope patterns (the whole module is replaced, scope "module") have no rewrite.
3. ``validate(match, module, ctx)`` runs per instance before anything changes; `Refusal`
   leaves that instance as it was, with the reason in the report.
4. ``build(match, module, ctx)`` creates the fused layers for one instance: for "forward"
   patterns it sets the new children on `module` and deletes the consumed ones; for "module"
   patterns it returns the replacement module, which the compiler puts in the parent's place.
   New parameters take the replaced parameters' device and dtype (meta included: the engine
   builds on meta and loads weights after); computed buffers go where the replaced module's
   buffers are.
5. ``describe(match) -> str``: one short phrase for the report ("q_proj,k_proj,v_proj -> qkv_proj").
6. ``shards(match) -> list[(new_child, [(old_child, shard_id), ...])]``: how fused parameters
   map back to the original ones; it drives both checkpoint loading and the HF-name state dict.

A match whose ``present`` is True reports a fusion the model already has (Phi-3's
``qkv_proj``): nothing is rewritten.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import libcst as cst
from torch import nn


class Refusal(ValueError):
    """The pattern cannot prove its rewrite; the message is the reason shown in the report."""


@dataclasses.dataclass(frozen=True)
class Match:
    """One occurrence of a pattern in a class's graph (names and class-wide facts only)."""

    pattern: type["Pattern"]
    claimed: frozenset[str]
    """fx node names this match owns (disjointness check)."""
    names: tuple[tuple[str, str], ...]
    """(role, attribute name) pairs, e.g. (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"))."""
    facts: tuple[tuple[str, Any], ...] = ()
    """Class-wide facts: (key, value), e.g. (("act", "silu"),)."""
    present: bool = False
    """True: the model already has this fusion; reported, not rewritten."""

    def name(self, role: str) -> str:
        """The attribute or node name recorded for `role`; KeyError for a role the match lacks."""
        return dict(self.names)[role]

    def fact(self, key: str, default: Any = None) -> Any:
        """The class-wide fact `key`, or `default` when the match did not record it."""
        return dict(self.facts).get(key, default)


PREFUSED_ATTR = "_fxrewrite_prefused"
"""On a rewritten module: [(kind "qkv" / "merged", child name, facts)] for projections the model ships fused (Phi-3's
``qkv_proj`` / ``gate_up_proj``), kept as they are and proven split at head / half boundaries, for tensor parallelism."""


@dataclasses.dataclass
class Context:
    """What patterns may read besides the module: the model and its (text) config, and whether a rewrite may merge
    parameters (``optimize(merge_weights=...)``; False keeps every original Parameter, see `fxrewrite.merged_params`)."""

    model: nn.Module
    config: Any = None
    merge_weights: bool = True
    _sharing: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def sharing(self) -> tuple[dict, dict]:
        """({id(module): [(id(parent), qualified name)] for each parent holding it}, the same for each parameter
        and the modules holding it), over the model as it was when first asked: every pattern that copies weights
        asks in its validate, so before the first such build. Ids, so that no weight a build deletes is kept alive.
        `require_unshared` reads it."""
        if self._sharing is None:
            children: dict[int, list[tuple[int, str]]] = {}
            params: dict[int, list[tuple[int, str]]] = {}
            for path, module in self.model.named_modules(remove_duplicate=False):
                for name, child in module._modules.items():
                    if child is not None:
                        children.setdefault(id(child), []).append((id(module), f"{path}.{name}".lstrip(".")))
                for name, param in module._parameters.items():
                    if param is not None:
                        params.setdefault(id(param), []).append((id(module), f"{path}.{name}".lstrip(".")))
            self._sharing = (children, params)
        return self._sharing


class Pattern:
    """Base class; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    scope: ClassVar[str] = "forward"  # "forward": edit the host's source; "module": replace the module

    @classmethod
    def match(cls, traced, ctx: Context) -> list[Match]:
        """Every occurrence in `traced` (one class's `Traced`): [] for none, `Refusal` on a near miss."""
        raise NotImplementedError

    @classmethod
    def rewrite(cls, match: Match, src, tree: cst.Module) -> cst.Module:
        """`tree` (the class's forward, libcst) with this match edited in; `Refusal`/`SourceError` when unsafe."""
        return tree

    @classmethod
    def validate(cls, match: Match, module: nn.Module, ctx: Context) -> None:
        """Per-instance checks before anything changes; `Refusal` leaves this instance as it was."""
        return None

    @classmethod
    def build(cls, match: Match, module: nn.Module, ctx: Context):
        """Set the fused children on `module` (scope "forward") or return its replacement (scope "module")."""
        raise NotImplementedError

    @classmethod
    def describe(cls, match: Match) -> str:
        """One short phrase for the report, e.g. ``q_proj,k_proj,v_proj -> qkv_proj``."""
        return ", ".join(name for _, name in match.names)

    @classmethod
    def shards(cls, match: Match) -> list[tuple[str, list[tuple[str, Any]]]]:
        """``[(new_child, [(old_child, shard_id), ...])]``: where each replaced parameter lives now."""
        return []


def require(condition: bool, reason: str) -> None:
    """Raise `Refusal(reason)` unless `condition` holds (patterns' one-line checks)."""
    if not condition:
        raise Refusal(reason)


def free_attribute(module: nn.Module, name: str) -> None:
    """Refuse when `module` already has an attribute `name` (a new child would shadow it)."""
    require(not hasattr(module, name), f"attribute {name!r} already exists on {type(module).__name__}")


def require_same_requires_grad(mods: dict[str, nn.Module]) -> None:
    """Refuse when the linears to fuse ({child name: module}) disagree on `requires_grad` of a parameter (q_proj
    frozen, k_proj trained): their one fused parameter would freeze or train them all."""
    for pname in ("weight", "bias"):
        flags = {n: p.requires_grad for n, m in mods.items() if (p := getattr(m, pname, None)) is not None}
        require(len(set(flags.values())) <= 1, f"{', '.join(mods)} differ in {pname}.requires_grad ({flags}): "
                                               "fused, they would be trained or frozen together")


def require_unshared(ctx: Context, owner: nn.Module | None, mods: dict[str, nn.Module]) -> None:
    """Refuse when a module a fusion copies into a new one ({child name: module} of `owner`) is also another
    module's child or `owner`'s under another name, or one of its own parameters is also another module's (weights
    shared across layers, as in ALBERT or MobileLLM): the fused copy would untie them, so the shared weight would get
    each place's gradient apart and drift after the first optimizer step. A module shared as a whole (one decoder
    layer called twice) is rewritten once and stays shared. `owner` None: only the parameters are checked (a module
    replaced in every place it is a child: `fxrewrite.compiler`)."""
    children, params = ctx.sharing()
    for name, module in mods.items():
        places = children.get(id(module), []) if owner is not None else []
        shared = [(name, path) for parent, path in places if parent != id(owner)]
        names = {path.rpartition(".")[2] for parent, path in places if parent == id(owner)}
        shared += [(name, f"{'/'.join(sorted(names - {name}))} of the same module")] if len(names) > 1 else []
        shared += [(f"{name}.{pname}".lstrip("."), path) for pname, param in module._parameters.items()
                   if param is not None for holder, path in params.get(id(param), []) if holder != id(module)]
        if shared:
            raise Refusal(f"{shared[0][0]} is also {shared[0][1]} (shared weights): a fused copy would untie them")


def copy_requires_grad(new: nn.Module, *old: nn.Module) -> None:
    """Each fused parameter is trainable only if the parameters of its name it replaces were (weight and bias
    apart, so bias-only training such as BitFit keeps its biases trainable)."""
    for name, p in new.named_parameters(recurse=False):
        p.requires_grad_(all(getattr(m, name).requires_grad for m in old))
