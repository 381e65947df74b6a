"""In-place weight updates of a running engine's model (RL: the trainer's weights into the sampler).

`plan_update(model, metas)` resolves every incoming (name, shape) to an engine parameter and checks it
before anything is copied: a wrong shape or (strict) an unknown name or a parameter left without a tensor
is a ValueError naming the tensor and both shapes (strict=False skips unknown names with a warning).
`apply_update(plan, tensors)` then copies each tensor into the existing storage (`param.copy_` / the parameter's `weight_loader`, which narrows to this
tensor-parallel rank's rows), so no parameter is reallocated and captured CUDA graphs stay valid.

Accepted names (the source's own layout decides, nothing is re-fused):
- the engine's fused names (``model.layers.0.self_attn.qkv_proj.weight``), as an optimized training
  model (`fxrewrite.optimize`) or a native model names them: one copy per fused tensor;
- Hugging Face names (``...q_proj.weight``): copied into their shard of the fused tensor (the fusion's
  shard table, `fxrewrite.weights.shard_map`, or a native model's ``packed_modules_mapping``);
- either with the engine wrapper's ``hf_model.`` prefix or torch.compile's ``_orig_mod.`` segments; a model in a
  DistributedDataParallel / DataParallel wrapper is read as the model it holds (`unwrap_data_parallel`).
A PEFT model (LoRA and the other mergeable tuners) is read with its adapters merged (`merged_peft`), in the base
checkpoint's names, as TRL syncs one into vLLM.
Shapes are always the full (unsharded) ones; each rank takes its slice, and each pipeline stage its layers.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from fxrewrite.kernels.fp8_gemm import FP8_DTYPE
from fxrewrite.layers.fp8_linear import SCALE_NAME, Fp8LinearMixin, requantize_fp8_layer
from fxrewrite.layers.fp8_sync import fp8_sync_staging, load_block_quantized, part_rows
from fxrewrite.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fxrewrite.layers.vocab_embedding import VocabParallelEmbedding
from fxrewrite.weights import default_weight_loader, shard_map

logger = logging.getLogger(__name__)

_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
"""Computed buffers some checkpoints carry; never part of an update."""


@dataclass
class Target:
    """Where one incoming tensor goes: `param` (the engine's, named `name`), whole or shard `shard_id`."""

    name: str
    param: nn.Parameter
    owner: nn.Module
    shard_id: Any
    shape: tuple[int, ...]
    """The full (unsharded) shape the incoming tensor must have."""
    required: bool = True
    """False for a persistent buffer (DeepSeek's ``e_score_correction_bias``): copied when sent, as
    ``load_state_dict`` would, but not asked for (a trainer's ``named_parameters`` does not hold it)."""

    @property
    def direct(self) -> bool:
        """A plain copy into the whole parameter (same shape on this rank, no loader logic)."""
        return self.shard_id is None and self.shape == tuple(self.param.shape) \
            and not isinstance(self.owner, VocabParallelEmbedding)


def named_weights(source) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an nn.Module (its parameters, tied ones once) or of an iterable of pairs.
    TypeError for anything else, a string included, and for a pair whose tensor is not floating point."""
    if isinstance(source, nn.Module):
        source = [(name, p.detach()) for name, p in source.named_parameters()]
    if isinstance(source, dict):
        source = source.items()
    if isinstance(source, (str, bytes)):
        raise TypeError(f"load_weights expects an nn.Module or an iterable of (name, tensor) pairs, got "
                        f"{type(source).__name__} {source!r:.80} (load a checkpoint into a model first)")
    try:
        pairs = list(source)
    except TypeError:
        raise TypeError(f"load_weights expects an nn.Module or an iterable of (name, tensor) pairs, "
                        f"got {type(source).__name__}") from None
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"load_weights: item {i} must be a (name, torch.Tensor) pair, got {pair!r:.80}")
        if not (pair[1].is_floating_point() or pair[1].dtype == torch.float8_e4m3fn):
            raise TypeError(f"load_weights: tensor {pair[0]!r} has dtype {pair[1].dtype}; expected a floating-point "
                            "tensor (weights are cast from any float dtype, never from integers)")
        if pair[1].is_meta or pair[1].layout != torch.strided:  # checked here: a copy would fail halfway
            what = "on the meta device" if pair[1].is_meta else pair[1].layout
            raise TypeError(f"load_weights: tensor {pair[0]!r} is {what}; expected a dense tensor holding values "
                            "(materialize an offloaded or empty-init model first)")
    return [(name, t.detach()) for name, t in pairs]


def unwrap_data_parallel(source):
    """The module a `DistributedDataParallel` / `DataParallel` wrapper holds (a trainer's model as its loop has it:
    its parameters' names carry the wrapper's ``module.`` prefix, which no engine name has), else `source`."""
    while isinstance(source, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        source = source.module
    return source


@contextlib.contextmanager
def merged_peft(source):
    """`source` as `named_weights` should read it. A PEFT model (peft's PeftModel: `get_base_model`) with a
    mergeable tuner (LoRA, DoRA, IA3, ...): its active adapters merged into the base weights while the block runs
    and unmerged after (left as they were if already merged, and not merged while disabled, as with
    ``disable_adapter()``), read after the merge (DoRA and IA3 replace a weight's tensor rather than add to it) as
    the base model's (name, tensor) pairs in the base checkpoint's names (a tuner layer's ``base_layer``, a
    ``modules_to_save`` wrapper's active copy, the adapters' own tensors skipped). Anything else passes through.
    TypeError, before anything is merged, for a PEFT model whose adapters cannot be merged (prompt learning) or a
    PEFT layer this cannot read (trainable tokens: merge_and_unload a copy first)."""
    if not (isinstance(source, nn.Module) and callable(getattr(source, "get_base_model", None))):
        yield source
        return
    tuner, base = getattr(source, "base_model", None), source.get_base_model()
    merge, unmerge = getattr(tuner, "merge_adapter", None), getattr(tuner, "unmerge_adapter", None)
    if not (callable(merge) and callable(unmerge)):
        raise TypeError(f"load_weights: the adapters of {type(source).__name__} ({type(tuner).__name__}) cannot be "
                        "merged into its weights; pass (name, tensor) pairs of the weights to serve")
    list(_peft_base_pairs(base))  # every PEFT layer readable: checked before anything is merged
    layers = [m for m in base.modules() if hasattr(m, "adapter_layer_names")]
    leave = any(getattr(m, "merged", False) or getattr(m, "disable_adapters", False) for m in layers)
    with torch.no_grad():
        if not leave:
            merge()
        try:
            yield list(_peft_base_pairs(base))
        finally:
            if not leave:
                unmerge()


def _peft_base_pairs(module: nn.Module, prefix: str = "",
                     seen: set | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, detached parameter) of `module` with every PEFT layer replaced by the module it stands for: a
    tuner layer (``adapter_layer_names``) by its ``base_layer``, a modules_to_save wrapper by the active adapter's
    copy (its original module when adapters are disabled or the adapter has no copy); tied parameters once, as
    `named_parameters` gives them. TypeError for another PEFT layer."""
    seen = set() if seen is None else seen
    if hasattr(module, "adapter_layer_names"):
        if isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict) and hasattr(module, "original_module"):
            active = [] if module.disable_adapters else [
                a for a in module.active_adapters if a in module.modules_to_save]
            module = module.modules_to_save[active[0]] if active else module.original_module
        elif isinstance(getattr(module, "base_layer", None), nn.Module):
            module = module.base_layer
        else:
            raise TypeError(f"load_weights: PEFT layer {prefix.rstrip('.') or '(model)'} ({type(module).__name__}) is "
                            "not a tuner layer over a base layer nor a modules_to_save copy; sync the weights of a "
                            "merge_and_unload()ed copy instead")
        yield from _peft_base_pairs(module, prefix, seen)
        return
    for name, param in module._parameters.items():
        if param is not None and id(param) not in seen:
            seen.add(id(param))
            yield prefix + name, param.detach()
    for name, child in module._modules.items():
        if child is not None:
            yield from _peft_base_pairs(child, f"{prefix}{name}.", seen)


def _normalize(name: str, wrapper_prefix: str) -> str:
    name = name.replace("_orig_mod.", "")
    if not wrapper_prefix:  # a native engine model, fed from an engine's transformers wrapper
        return name.removeprefix("hf_model.")
    return name if name.startswith(wrapper_prefix) else wrapper_prefix + name


_TABLE = "_fxrewrite_sync_table"


def target_table(model: nn.Module) -> tuple[dict[str, Target], str]:
    """{accepted name: Target} over the engine model, and the wrapper prefix ("hf_model." or ""). Built
    once per model and kept on it: the engine never reallocates or replaces a parameter."""
    cached = model.__dict__.get(_TABLE)
    if cached is None:
        cached = model.__dict__[_TABLE] = _build_table(model)
    return cached


def _build_table(model: nn.Module) -> tuple[dict[str, Target], str]:
    hf = getattr(model, "hf_model", None)
    prefix = "hf_model." if isinstance(hf, nn.Module) else ""
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    table: dict[str, Target] = {}

    def add(name: str, pname: str, shard_id) -> None:
        param = params[pname]
        owner = owners[id(param)]
        table[name] = Target(pname, param, owner, shard_id, full_shape(owner, param, shard_id))

    params = dict(model.named_parameters(remove_duplicate=False))
    for name in params:
        add(name, name, None)
    if prefix:
        for hf_name, (fused, shard_id) in shard_map(hf).items():
            add(prefix + hf_name, prefix + fused, shard_id)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name, buffer in module._buffers.items():
            name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set and name not in table:
                table[name] = Target(name, buffer, module, None, tuple(buffer.shape), required=False)
    for part, (fused, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        part, fused = part.strip("."), fused.strip(".")  # keys with or without their dots, as the loader takes them
        for name in list(params):
            if f".{fused}." in name:
                add(name.replace(f".{fused}.", f".{part}."), name, shard_id)
    return table, prefix


def full_shape(owner: nn.Module, param: nn.Parameter, shard_id) -> tuple[int, ...]:
    """The unsharded shape of `param` (or of its shard `shard_id`) in a checkpoint, from its layer: the layer's or
    its weight_loader's own `full_shape(param)` where it has one (a tensor-parallel rank's whole experts,
    `fxrewrite.sharding_moe`; a `ShardedRMSNorm`), else read off the parallel linear / embedding."""
    own = getattr(owner, "full_shape", None) or getattr(getattr(param, "weight_loader", None), "full_shape", None)
    if callable(own):
        return own(param)
    is_weight = param is getattr(owner, "weight", None)
    if isinstance(owner, QKVParallelLinear):
        q, kv = owner.total_num_heads * owner.head_size, owner.total_num_kv_heads * owner.head_size
        rows = {None: q + 2 * kv, "q": q, "k": kv, "v": kv}[shard_id]
    elif isinstance(owner, MergedColumnParallelLinear):
        rows = sum(owner.output_sizes) if shard_id is None else owner.output_sizes[shard_id]
    elif isinstance(owner, (ColumnParallelLinear, RowParallelLinear)):
        rows = owner.output_size
    elif isinstance(owner, VocabParallelEmbedding):
        rows = owner.num_embeddings
    else:
        return tuple(param.shape)
    if not is_weight:
        return (rows,)
    cols = owner.input_size if isinstance(owner, (ColumnParallelLinear, RowParallelLinear)) else param.shape[1]
    return (rows, cols)


def plan_update(model: nn.Module, metas: list[tuple[str, tuple[int, ...]]], strict: bool = True) -> list[Target | None]:
    """One Target per incoming (name, shape) (None: skipped); ValueError listing every wrong shape, every name given
    twice and, with `strict`, every unknown name and parameter no tensor covers, before anything is copied.

    strict=False is torch's `load_state_dict(strict=False)`: a name that matches no parameter (an extra
    buffer, another model's head) is skipped and logged as a warning, a parameter without a tensor keeps
    its value; a wrong shape is still an error."""
    table, prefix = target_table(model)
    # A pipeline stage holds only its decoder layers: another stage's tensors are that stage's to check and copy.
    other_stages = tuple(prefix + p for p in getattr(model, "pp_dropped_prefixes", ()))
    plan, errors, covered, unexpected, seen = [], [], {}, [], set()
    for name, shape in metas:
        if name in seen:  # the last copy would win silently
            errors.append(f"tensor {name!r} is given twice")
        seen.add(name)
        if any(s in name for s in _SKIPPED) or (other_stages and _normalize(name, prefix).startswith(other_stages)):
            plan.append(None)
            continue
        target = table.get(_normalize(name, prefix))
        if target is None and not strict:
            unexpected.append(name)
        elif target is None:
            errors.append(f"tensor {name!r} of shape {tuple(shape)} matches no parameter of the engine's model "
                          "(strict=False skips such tensors)")
        else:
            if tuple(shape) != target.shape:
                part = f" (shard {target.shard_id!r})" if target.shard_id is not None else ""
                errors.append(f"tensor {name!r} has shape {tuple(shape)}, but the engine's parameter "
                              f"{target.name!r}{part} needs {target.shape}")
            covered.setdefault(id(target.param), set()).add(target.shard_id)  # sent: its shape is the one error
        plan.append(target)
    if strict:
        errors += _missing(table, covered)
    if errors:
        shown = "; ".join(errors[:8]) + (f"; and {len(errors) - 8} more" if len(errors) > 8 else "")
        raise ValueError(f"load_weights: nothing was updated: {shown}")
    if unexpected:
        logger.warning("load_weights(strict=False): skipped %d tensor(s) matching no parameter of the engine's "
                       "model: %s", len(unexpected), ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""))
    return plan


def coverage(plan: list[Target | None], into: dict[int, set] | None = None) -> dict[int, set]:
    """id(param) -> the shard ids (None: whole) a plan writes, added to `into` when given."""
    out = {} if into is None else into
    for target in plan:
        if target is not None:
            out.setdefault(id(target.param), set()).add(target.shard_id)
    return out


def uncovered(model: nn.Module, covered: dict[int, set]) -> list[str]:
    """The model's parameters `covered` (from `coverage`) does not write whole, one message each."""
    return _missing(target_table(model)[0], covered)


def _missing(table: dict[str, Target], covered: dict[int, set]) -> list[str]:
    """Parameters with neither a whole tensor nor every shard among the incoming ones."""
    shards: dict[int, dict] = {}
    for t in table.values():
        if t.name.endswith("." + SCALE_NAME) or not t.required:  # a scale is made from a float weight (apply_update)
            continue
        entry = shards.setdefault(id(t.param), {"name": t.name, "shape": None, "ids": set()})
        if t.shard_id is None:
            entry["name"], entry["shape"] = t.name, t.shape
        else:
            entry["ids"].add(t.shard_id)
    out = []
    for pid, entry in shards.items():
        got = covered.get(pid, set())
        if None in got or (entry["ids"] and entry["ids"] <= got):
            continue
        need = f" (or its shards {sorted(map(str, entry['ids'] - got))})" if entry["ids"] else ""
        out.append(f"no tensor for the engine's parameter {entry['name']!r} of shape {entry['shape']}{need}")
    return out


@torch.no_grad()
def apply_update(plan: list[Target | None], tensors: Iterable[torch.Tensor]) -> None:
    """Copy each tensor into its planned target, in place (plain copies batched in one foreach call). A float
    weight for an FP8 layer is loaded into a float copy of the layer's weight, then quantized as at load
    (`fp8_linear.requantize_fp8_layer`: new scales; on a CPU the FP8-rounded values). TypeError, before anything
    is copied, for FP8 tensors the engine would read as other numbers (see `_check_fp8`)."""
    pairs = [(target, tensor) for target, tensor in zip(plan, tensors) if target is not None]
    _check_fp8(pairs)
    _check_tied(pairs)
    dst, src, fp8_weights = [], [], {}
    for target, tensor in pairs:
        fp8 = isinstance(target.owner, Fp8LinearMixin) and target.param is target.owner.weight
        if fp8 and tensor.dtype != FP8_DTYPE and not target.owner.weight_per_channel:
            load_block_quantized(target.owner, tensor, target.shard_id)  # the checkpoint's block grid, any rank
        elif fp8 and tensor.dtype != FP8_DTYPE:  # per-row scales over this rank's columns, as at load
            fp8_weights.setdefault(id(target.owner), []).append((target, tensor))
        elif target.direct:
            dst.append(target.param.data)
            src.append(tensor.to(target.param.device, target.param.dtype, non_blocking=True))
        else:
            _load(target.param, target, tensor)
    if dst:
        torch._foreach_copy_(dst, src)
    for parts in fp8_weights.values():  # one layer's float copy at a time
        layer = parts[0][0].owner
        staging = fp8_sync_staging(layer)
        for target, tensor in parts:
            _load(staging, target, tensor)  # the layer's loader shards into the copy as into the weight
        rows = sorted({r for target, _ in parts for r in part_rows(layer, target.shard_id)})
        requantize_fp8_layer(layer, staging.data, rows)  # the parts sent, each on its own; the others keep their bytes


def _check_tied(pairs: list[tuple[Target, torch.Tensor]]) -> None:
    """ValueError, before anything is copied, when two tensors load one part of an engine parameter with different
    values: names the engine ties (a tied model's ``lm_head.weight`` and ``embed_tokens.weight``) sent apart, as by a
    trainer whose head was untied (PEFT's ``modules_to_save=["lm_head"]``); the last copy won silently."""
    first: dict[tuple[int, Any], tuple[Target, torch.Tensor]] = {}
    for target, tensor in pairs:
        seen = first.setdefault((id(target.param), target.shard_id), (target, tensor))
        if seen[1] is tensor or _same_values(seen[1], tensor.to(seen[1].device, seen[1].dtype)):
            continue
        names = " and ".join(dict.fromkeys(repr(t.name) for t in (seen[0], target)))
        raise ValueError(f"load_weights: nothing was updated: two tensors with different values load the engine's "
                         f"{names} (one tied parameter in the engine's model); send one value for both (untied in "
                         "the trainer, e.g. PEFT's modules_to_save=['lm_head'], they cannot be synced into a tied "
                         "engine: serve a model with tie_word_embeddings=false)")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, a NaN equal to a NaN in the same place (a diverged tied model's head and embedding are one
    tensor: `torch.equal` alone took them for two)."""
    return torch.equal(a, b) or bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def _load(param: nn.Parameter, target: Target, tensor: torch.Tensor) -> None:
    loader = getattr(param, "weight_loader", None) or getattr(target.owner, "weight_loader", None)
    loader = loader if callable(loader) else default_weight_loader
    loader(param, tensor, target.shard_id) if target.shard_id is not None else loader(param, tensor)


def _check_fp8(pairs: list[tuple[Target, torch.Tensor]]) -> None:
    """TypeError naming the tensor: an FP8 tensor for a parameter that is not FP8 (a layer dequantized on a CPU
    reads plain numbers: dequantize first, fp8 * weight_scale_inv), an FP8 weight sent without its layer's scales,
    or a float tensor for FP8 parameters no FP8 linear layer owns (MoE experts: not re-quantized on sync)."""
    scaled = {id(t.owner) for t, _ in pairs if t.param is getattr(t.owner, SCALE_NAME, None)}
    for target, tensor in pairs:
        fp8_in, fp8_param = tensor.dtype == FP8_DTYPE, target.param.dtype == FP8_DTYPE
        if fp8_in and not fp8_param:
            why = f"the engine's parameter {target.name!r} holds {target.param.dtype} values; dequantize it first"
        elif fp8_in and target.param is getattr(target.owner, "weight", None) and id(target.owner) not in scaled:
            why = f"its scales ({target.name.rsplit('.', 1)[0]}.{SCALE_NAME}) are not sent with it"
        elif fp8_param and not fp8_in and not isinstance(target.owner, Fp8LinearMixin):
            why = (f"the engine's parameter {target.name!r} is float8_e4m3fn outside an FP8 linear layer, which a "
                   f"{tensor.dtype} sync does not re-quantize")
        else:
            continue
        raise TypeError(f"load_weights: nothing was updated: tensor for {target.name!r} is {tensor.dtype}, but {why}")


def update_weights(model: nn.Module, weights: list[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
    """Validate everything, then copy (see the module docstring); returns the engine parameter names updated."""
    plan = plan_update(model, [(name, tuple(t.shape)) for name, t in weights], strict)
    apply_update(plan, [t for _, t in weights])
    return {t.name for t in plan if t is not None}
