"""`optimize(model)`: trace each module structure, match `PATTERNS`, rewrite, build, bind per instance.

Per module class (children before parents, so a parent sees its fused children), per group of its
instances with one structure (`fxrewrite.signature.structure_key`) and one input shape:
1. trace the group's first instance with the inputs recorded by a meta run (`fxrewrite.tracer`;
   `fxrewrite.meta_memo` runs each structure on meta once);
2. run every pattern's `match` on that graph once (the per-structure match cache); near misses and
   nodes claimed twice become "skipped" lines of the report;
3. "module" patterns: per instance `validate`, then `build` a replacement put in the parent's place;
4. "forward" patterns: each match's source edit is tried alone first (a refusal drops that match); per instance,
   the matches whose `validate` passes are applied: the source with exactly those edits is compiled once per
   distinct set, `build` creates the fused children, and the new forward is bound to that instance only.
The model is changed in place; a second `optimize` is a no-op. The `FusionReport` is kept on the model
(`explain`). Fail closed: any refusal leaves that module (or instance) as it was; an instance whose forward someone
else replaced, or whose children to fuse away carry hooks or a replaced forward, is refused. Users' hooks do not run
during optimize's meta runs and probes; transformers' output recorders are not users' hooks (`fxrewrite.user_hooks`).
"""

from __future__ import annotations

import weakref
from collections import defaultdict

from torch import nn

from fxrewrite import bound_forward, foreign, merged_params, options, signature, source, tracer, train_eval, user_hooks, weights, wrappers
from fxrewrite.layers.linear import no_weight_init
from fxrewrite.layers.sdpa_causal import SDPA_CAUSAL, sdpa_read_by_name, use_sdpa_causal
from fxrewrite.optimizer_state import HF_NAMES_ATTR
from fxrewrite.patterns import Context, Match, Refusal
from fxrewrite.meta_memo import MetaMemo
from fxrewrite.report import ATTENTION_NOTE, REPORT_ATTR as _REPORT_ATTR, ClassReport, FusionReport, GroupReport, explain
from fxrewrite.signature import BOUND_ATTR, HOOK_DICTS, input_key, instance_forward, structure_key


def optimize(model: nn.Module, **opts) -> nn.Module:
    """Rewrite `model` in place to use fused layers; returns the same object.

    Options: ``patterns`` (a tuple of pattern classes, default `fxrewrite.patterns.PATTERNS`);
    ``example_inputs`` = (args, kwargs) for `model.forward` when it is not a causal LM taking
    ``input_ids`` (only shapes/dtypes matter: they are turned into meta tensors); ``merge_weights``
    (default True) = False keeps q/k/v and gate/up as separate Parameters (their fusions are skipped), for
    optimizers whose update depends on each tensor as a whole (`fxrewrite.merged_params`).
    Works with parameters on any device, meta included (the serving engine builds on meta and
    loads weights afterwards with `fxrewrite.weights.load_hf_weights`). Raises TypeError for an
    unknown option or a bad option value (`fxrewrite.options`), a model that is not an `nn.Module`, or one
    that torch.compile, DDP, DataParallel or FSDP already wraps (`fxrewrite.wrappers`: optimize first, then
    wrap); `fxrewrite.foreign.ForeignPatchError` when transformers code the model uses, or a module's forward,
    was replaced (e.g. by Liger-Kernel).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize expects a torch.nn.Module, got {type(model).__name__}")
    patterns, example_inputs, merge_weights = options.checked(opts)  # TypeError naming a bad option or value
    if getattr(model, _REPORT_ATTR, None) is not None:
        options.check_same_options(model, patterns, merge_weights)
        return model
    wrappers.check_not_wrapped(model)  # TypeError: e.g. optimize(torch.compile(model))
    foreign.check_no_foreign_patches(model)  # ForeignPatchError: e.g. Liger-Kernel patched transformers first
    model.__dict__[HF_NAMES_ATTR] = [name for name, _ in model.named_parameters()]  # optimizer_state_dict's order
    watched = merged_params.watch(model)  # an optimizer built before optimize still holds the replaced ones
    report = FusionReport()
    ctx = Context(model, _text_config(model), merge_weights)
    with user_hooks.suspended(model):  # users' hooks must not see the meta run's tensors
        records, error = tracer.record_calls(model, example_inputs=example_inputs)
    user_hooks.drop_output_recorders(model)  # transformers' own, put back on the rewritten modules
    records = {k: (weakref.ref(m), args, kwargs) for k, (m, args, kwargs) in records.items()}  # fused-away ones go
    if error:
        report.notes.append(f"meta run stopped early ({error}); classes not reached are left unchanged")
    if user_hooks.global_hooks():
        report.notes.append(f"{user_hooks.global_hooks()} global module hook(s) (register_module_*_hook) are set: "
                            "they run for the fused modules instead of the modules fused into them")
    names, memo = {id(m): n or "(model)" for n, m in model.named_modules()}, MetaMemo()
    by_class = _classes_children_first(model)
    for cls, instances in by_class.items():
        entry = report.entry(cls.__name__)
        entry.instances = len(instances)
        _optimize_groups(cls, instances, records, names, memo, patterns, ctx, entry, model)
    _note_replaced_with_parents(model, by_class, names, report)
    if use_sdpa_causal(model):  # torch.compile keeps SDPA's implicit causal mask (flash, no k/v copies)
        report.notes.append(f"{ATTENTION_NOTE}{SDPA_CAUSAL} (transformers' SDPA; under torch.compile no materialised "
                            "causal mask for a call without attention_mask / position_ids / cache)")
    elif getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa" and (where := sdpa_read_by_name(model)):
        report.notes.append(f"{ATTENTION_NOTE}sdpa stays ({where} compares _attn_implementation with 'sdpa')")
    model.__dict__[_REPORT_ATTR] = report
    options.remember(model, patterns, merge_weights)
    weights.install_hf_name_hooks(model)
    weights.mark_fused_away(model)
    merged_params.track(model, weights.SHARDS_ATTR, watched)  # checks optimizers' first step
    return model


def _note_replaced_with_parents(model: nn.Module, by_class, names: dict[int, str], report: FusionReport) -> None:
    """Instances no longer in the model went with the modules holding them (the experts of a MoE block that became
    FusedMoE): the class's report names the replacement; when none is left, its own (moot) refusals are dropped.
    A class with no fusion of its own whose every instance the replacement kept as a child (the MoE router, whose
    weight FusedMoE reads) is named the same way."""
    alive = {id(m) for m in model.modules()}
    for cls, instances in by_class.items():
        gone = [m for m in instances if id(m) not in alive and id(m) in names]
        entry = report.entry(cls.__name__)
        if not gone and not entry.applied and instances and all(id(m) in names for m in instances):
            holders = [_replacing_holder(model, names[id(m)]) for m in instances]
            if all(holders):
                more = f" and {len(instances) - 1} more" if len(instances) > 1 else ""
                entry.replaced_with = f"kept inside {holders[0][0]}{more}, part of {type(holders[0][1]).__name__}"
            continue
        holder = _replacing_holder(model, names[id(gone[0])]) if gone else None
        if holder is None:
            continue
        more = f" and {len(gone) - 1} more" if len(gone) > 1 else ""
        share = "" if len(gone) == len(instances) else f"{len(gone)} of {len(instances)} "
        entry.replaced_with = f"{share}inside {holder[0]}{more}, now {type(holder[1]).__name__}"
        left = [m for m in instances if id(m) in alive and id(m) in names]
        parents = list(dict.fromkeys(names[id(m)].rpartition(".")[0] or "the model" for m in left))
        if share and left:  # the others are still in the model: their parents' rows say what became of them
            rest = f" and {len(parents) - 1} more" if len(parents) > 1 else ""
            entry.replaced_with += f"; the other {len(left)} in {parents[0]}{rest}"
        if not share:
            entry.skipped = []  # else the refusals stand for the instances left


def _replacing_holder(model: nn.Module, path: str) -> tuple[str, nn.Module] | None:
    """(path, module) of the nearest enclosing module of `path` that fxrewrite put in the model."""
    while "." in path:
        path = path.rsplit(".", 1)[0]
        try:
            holder = model.get_submodule(path)
        except AttributeError:  # the replacement has no child of that name
            continue
        if type(holder).__module__.startswith("fxrewrite."):
            return path, holder
    return None


def _optimize_groups(cls, instances, records, names, memo, patterns, ctx, entry: ClassReport, model) -> None:
    """Trace, match and rewrite each group of identical instances of `cls` (`_groups`) on its own. With several
    groups, refusals name the group's modules, and a group where a pattern found in another group is absent
    gets a line saying how its instances differ from the nearest such group's."""
    groups = _groups(instances, records)
    differ = {(id(a[0]), id(b[0])): signature.difference(a[0], b[0])  # before this class's rewrite changes them
              for a in groups for b in groups if a is not b} if len(groups) > 1 else {}
    nearness = {(id(a[0]), id(b[0])): signature.children_differing(a[0], b[0])
                for a in groups for b in groups} if len(groups) > 1 else {}
    found: list[tuple[list[nn.Module], object, set[str]]] = []
    for members in groups:
        group = entry if len(groups) == 1 else GroupReport(entry, [names.get(id(m), "?") for m in members])
        record = _record(records, members[0])
        if record is None:
            wrapper = type(members[0]).__module__.startswith("peft.")  # LoraModel: its base model's modules ran
            group.skip("trace", "a PEFT wrapper, not traced: its base model's modules have their own rows" if wrapper
                       else "not called during the meta run")
            continue
        args, kwargs = record
        traced, modes = train_eval.trace(members[0], args, kwargs, model, memo)  # modes(): `_optimize_class`
        found.append((members, group, _optimize_class(cls, members, traced, patterns, ctx, group, model, modes)))
    for members, group, names_found in found if len(groups) > 1 else ():
        nearest_first = sorted(found, key=lambda f: nearness[id(f[0][0]), id(members[0])])
        for other, other_group, other_found in nearest_first:  # only where this group lost a fusion and gained none
            for name in sorted(other_found - names_found - group.seen) if names_found < other_found else ():
                group.skip(name, f"not found in this instance's graph, unlike [{other_group.label}]: "
                           + differ[id(other[0]), id(members[0])])
                group.seen.add(name)


def _record(records: dict[int, tuple], module: nn.Module) -> tuple | None:
    """(args, kwargs) of `module`'s recorded call, or None."""
    ref, args, kwargs = records.get(id(module), (None, None, None))
    return (args, kwargs) if ref is not None and ref() is module else None


def _groups(instances: list[nn.Module], records: dict[int, tuple]) -> list[list[nn.Module]]:
    """Instances that share one trace and one match: equal `structure_key` now (children already rewritten)
    and equal `input_key` of their recorded call (`fxrewrite.signature`); those never called form one group."""
    groups: dict = {}
    for module in instances:
        record = _record(records, module)
        key = ("not called",) if record is None else (structure_key(module), input_key(*record))
        groups.setdefault(key, []).append(module)
    return list(groups.values())


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _classes_children_first(model: nn.Module) -> dict[type, list[nn.Module]]:
    by_class: dict[type, list[nn.Module]] = {}
    for _, module in reversed(list(model.named_modules())):
        cls = type(module)
        if cls.__module__.startswith(("torch.", "fxrewrite.")):  # our layers and torch built-ins
            continue
        by_class.setdefault(cls, []).insert(0, module)
    return by_class


def _match_all(traced, patterns, ctx, entry: ClassReport) -> list[Match]:
    matches: list[Match] = []
    claimed: set[str] = set()
    for pattern in patterns:
        try:
            found = pattern.match(traced, ctx)
        except (Refusal, source.SourceError) as e:
            entry.skip(pattern.name, str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a pattern bug must not break the model: fail closed
            entry.skip(pattern.name, f"match failed: {type(e).__name__}: {e}")
            continue
        for m in found:
            if m.claimed & claimed:  # disjoint by construction; never trust it blindly
                entry.skip(pattern.name, f"fx nodes {sorted(m.claimed & claimed)} already claimed")
                continue
            claimed |= m.claimed
            matches.append(m)
    return matches


def _optimize_class(cls, instances, traced, patterns, ctx, entry: ClassReport, model, modes) -> set[str]:
    """Match `traced` and rewrite `instances` (one group; `modes`: see `train_eval.trace`); the patterns matched."""
    if traced.partial:
        entry.skip("trace", f"stopped at {traced.error}")
    with user_hooks.suspended(traced.module):  # patterns may probe children (an activation on a ramp)
        matches = _match_all(traced, patterns, ctx, entry)
    matched = {m.pattern.name for m in matches}
    for line in (f"{m.pattern.name}: {m.pattern.describe(m)}" for m in matches if m.present):
        if line not in entry.present:  # several groups of one class may each find it
            entry.present.append(line)
    matches = [m for m in matches if not m.present]
    module_matches = train_eval.refuse_if_mode_dependent([m for m in matches if m.pattern.scope == "module"],
                                                         entry, modes)
    forward_matches = [m for m in matches if m.pattern.scope == "forward"]
    if module_matches:
        _replace_modules(instances, module_matches, ctx, entry, model)
    if forward_matches:
        _rewrite_forwards(cls, instances, forward_matches, ctx, entry)
    return matched


def _applied(entry: ClassReport, m: Match) -> None:
    counts = entry.applied.setdefault(m.pattern.name, {})
    desc = m.pattern.describe(m)
    counts[desc] = counts.get(desc, 0) + 1


def _replace_modules(instances, matches: list[Match], ctx, entry: ClassReport, model) -> None:
    """Each instance is replaced by the first module-scope match that validates and builds; the
    others get a report line each (a module can be replaced only once)."""
    parents = _parents(model)
    for module in instances:
        slots = parents.get(id(module), [])
        if not slots:
            for m in matches:
                entry.skip(m.pattern.name, "the module has no parent to be replaced in")
            continue
        winner = None
        for m in matches:
            if winner is not None:
                entry.skip(m.pattern.name, f"the module is already replaced by {winner.pattern.name}")
                continue
            try:
                _check_instance(m, module)  # sees the hooks, before they are suspended for the probes
                with user_hooks.suspended(module):
                    m.pattern.validate(m, module, ctx)
                    new = m.pattern.build(m, module, ctx)
            except Refusal as e:
                entry.skip(m.pattern.name, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - building the replacement failed: keep the original
                entry.skip(m.pattern.name, f"build failed: {type(e).__name__}: {e}")
                continue
            for parent, name in slots:
                setattr(parent, name, new)
            _applied(entry, m)
            winner = m


def _parents(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for _, parent in model.named_modules(remove_duplicate=False):
        for name, child in parent._modules.items():  # not named_children: it lists a child under one name only
            out[id(child)].append((parent, name))  # (a None child's entry is never looked up)
    return out


def _rewrite_forwards(cls, instances, matches: list[Match], ctx, entry: ClassReport) -> None:
    try:
        src = source.ForwardSource.recover(cls)
    except source.SourceError as e:
        for m in matches:
            entry.skip(m.pattern.name, str(e))
        return
    usable = []
    for m in matches:  # each edit alone first: a refusal drops only that match
        merged = [old for _, parts in m.pattern.shards(m) for old, _ in parts]
        if merged and not ctx.merge_weights:
            entry.skip(m.pattern.name, f"merge_weights=False: {', '.join(merged)} stay separate parameters")
            continue
        try:
            m.pattern.rewrite(m, src, src.tree)
            usable.append(m)
        except (Refusal, source.SourceError) as e:
            entry.skip(m.pattern.name, str(e))
    compiled: dict[tuple[int, ...], object] = {}
    for module in instances:
        valid = [m for m in usable if _valid(m, module, ctx, entry)]
        key = tuple(usable.index(m) for m in valid)
        if not valid:
            continue
        if key not in compiled:
            compiled[key] = _compile(src, valid, entry)
        if compiled[key] is None:
            continue
        if not _build_all(module, valid, ctx, entry):
            continue
        for m in valid:
            _applied(entry, m)
            module.__dict__.setdefault(weights.SHARDS_ATTR, []).extend(m.pattern.shards(m))
        bound_forward.bind(module, compiled[key][0])
    if compiled:
        widest = max((k for k, v in compiled.items() if v is not None), key=len, default=None)
        entry.diff = src.diff(compiled[widest][1]) if widest is not None else ""


def _build_all(module: nn.Module, matches: list[Match], ctx, entry: ClassReport) -> bool:
    """Build every match's fused children on `module`, all or nothing: if one build raises, the
    module's children, parameters, buffers and attributes are put back as they were (builds only
    set and delete attributes of `module`), and the failure is reported. True if all were built."""
    saved = {key: dict(module.__dict__[key]) for key in ("_modules", "_parameters", "_buffers")}
    saved_attrs = {k: v for k, v in module.__dict__.items() if k not in saved}
    for m in matches:
        try:
            with no_weight_init(), user_hooks.suspended(module):  # every build loads all its new layers' weights
                m.pattern.build(m, module, ctx)
        except Exception as e:  # noqa: BLE001 - a failed build must not leave the module half-rewritten
            module.__dict__.clear()
            module.__dict__.update(saved_attrs)
            for key, value in saved.items():
                module.__dict__[key] = value
            others = [o.pattern.name for o in matches if o is not m]
            entry.skip(m.pattern.name, f"build failed: {type(e).__name__}: {e}; the module is left as it was"
                       + (f" (not applied with it: {', '.join(others)})" if others else ""))
            return False
    return True


def _valid(m: Match, module: nn.Module, ctx, entry: ClassReport) -> bool:
    try:
        _check_instance(m, module)
        with user_hooks.suspended(module):  # validate may probe the module's children
            m.pattern.validate(m, module, ctx)
        return True
    except Refusal as e:
        entry.skip(m.pattern.name, str(e))
    except Exception as e:  # noqa: BLE001 - validate has no side effects on the module: fail closed
        entry.skip(m.pattern.name, f"validate failed: {type(e).__name__}: {e}")
    return False


def _compile(src, matches: list[Match], entry: ClassReport):
    tree = src.tree
    try:
        for m in matches:
            tree = m.pattern.rewrite(m, src, tree)
        fn = source.compile_forward(src, tree)
    except (Refusal, source.SourceError, SyntaxError) as e:
        entry.skip("+".join(m.pattern.name for m in matches), f"combined rewrite failed: {e}")
        return None
    return fn, tree


def _check_instance(m: Match, module: nn.Module) -> None:
    """Refusal when rewriting this instance would drop someone else's code: a forward replaced on the instance
    (the rewrite binds its own), or hooks on, or a forward replaced on, a child the fusion deletes or a module
    below it (or hooks on the module a module-scope pattern replaces)."""
    own = _replaced(module)
    if own is not None:
        raise Refusal(f"the forward of this {type(module).__name__} instance is replaced "
                      f"({getattr(own, '__qualname__', type(own).__name__)}); left as it is")
    children = [(name, c) for _, name in m.names if isinstance(c := module._modules.get(name), nn.Module)]
    replaced = [f"child {name!r}" for name, c in children if any(_replaced(x) is not None for x in c.modules())]
    if replaced:
        raise Refusal(f"the forward of {', '.join(replaced)} (or of a module in it) is replaced on the instance and "
                      "would be lost by the fusion; left as it is")
    hooked = [f"child {name!r}" for name, c in children if _hooked(c)]
    own = m.pattern.scope == "module" and _hooked(module, deep=False)  # module scope: the module is replaced
    inside = m.pattern.scope == "module" and not (own or hooked) and _hooked(module)  # a module no child named
    hooked = ["the module itself"] * own + hooked + ["a module inside it"] * inside
    if hooked:
        raise Refusal(f"forward/backward hooks on {', '.join(hooked)} would be lost by the fusion; left as it is")


def _replaced(module: nn.Module):
    """The forward someone else put on this instance (not the one fxrewrite bound), or None."""
    own = instance_forward(module)
    return None if own is None or own is module.__dict__.get(BOUND_ATTR, (None, None))[1] else own


def _hooked(module: nn.Module, deep: bool = True) -> bool:
    return any(m.__dict__.get(h) for m in (module.modules() if deep else [module]) for h in HOOK_DICTS)
