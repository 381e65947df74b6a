"""The engine's RL operations: in-place weight sync and sleep mode (mixed into `LLMEngine`).

A GRPO/PPO loop trains with `fxrewrite.optimize(model)` and samples with the engine in one process:
``llm.load_weights(model)`` after each optimizer step, ``llm.sleep()`` while training needs the memory,
``llm.wake_up()`` before the next rollouts. Each needs an idle engine (no unfinished request), and both
drop the prefix cache, whose K/V would be stale (new weights) or gone (slept).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from fxrewrite.errors import UserInputError, UserTypeError
from fxrewrite.runtime.model_files.checkpoint_conversion import checkpoint_layout_to_model
from fxrewrite.runtime.worker.model_runner import resolve_model_impl
from fxrewrite.runtime.worker.moe_checks import moe_sizes
from fxrewrite.runtime.worker.weight_sync import merged_peft, named_weights, unwrap_data_parallel
from fxrewrite.weights import to_hf_names


class EngineRLMixin:
    """`load_weights`, `sleep`, `wake_up`, `is_sleeping`, `reset_prefix_cache` for `LLMEngine`."""

    def _check_idle(self, what: str) -> None:
        if not self.requests and self._inflight is not None:
            # async scheduling: a step launched for sequences that stopped meanwhile; its tokens are dropped
            step, self._inflight = self._inflight, None
            self._complete(step)
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} needs an idle engine: {len(self.requests)} request(s) unfinished "
                               "(finish or abort them first)")

    def load_weights(self, weights: nn.Module | Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Copy new weights into the engine's model in place (no reallocation: CUDA graphs stay valid).

        `weights`: a model (its `named_parameters()`: an optimized one copies per fused tensor, a stock
        one per Hugging Face tensor into its shard; a PEFT model with its adapters merged for the copy,
        `weight_sync.merged_peft`; one in a DistributedDataParallel / DataParallel wrapper read as the model it
        holds) or (name, tensor) pairs in either naming, or a checkpoint's with one tensor per
        expert (``mlp.experts.3.gate_proj.weight``: each layer's experts stacked by transformers' conversion rules, all
        of a layer's experts in one call, `checkpoint_layout_to_model`). Tensors may
        be on any device and of any float dtype (cast to the engine's). With tensor parallelism every
        rank takes its slice. Everything is checked before anything is copied: ValueError naming the
        tensor and both shapes for a wrong shape and, with `strict`, an unknown name or an engine parameter
        no tensor covers; the engine then keeps its old weights. strict=False is torch's
        `load_state_dict(strict=False)`: unknown names are skipped (logged as a warning), uncovered
        parameters keep their values, a wrong shape is still an error. TypeError for another kind of `weights`;
        RuntimeError while requests are unfinished or the weights are asleep.
        Returns the engine parameter names written.
        """
        if not isinstance(strict, bool):  # "yes" or None would pass as truthy / falsy
            raise UserTypeError(f"load_weights: strict={strict!r}; expected True or False")
        self._check_idle("load_weights")
        with merged_peft(unwrap_data_parallel(weights)) as source:
            config = self.model_config
            pairs = named_weights(source)
            if isinstance(source, nn.Module) and not self._takes_fused_names():  # an optimized model's qkv_proj...
                pairs = list(to_hf_names(source, dict(pairs)).items())  # ...as q/k/v views for HF's own modules
            pairs = checkpoint_layout_to_model(pairs, config.hf_config.model_type, moe_sizes(config.hf_text_config)[0])
            try:
                return self.model_runner.load_weights(pairs, strict)
            finally:  # also after a failure: a copy that failed part way (a device error) may have written some
                self.reset_prefix_cache()

    def _takes_fused_names(self) -> bool:
        """Whether the engine's model has fused projections (native, or transformers rewritten): then an optimized
        trainer's fused tensors are copied whole; else (``fusion=False``) they arrive split, under HF names."""
        return self.config.fusion or resolve_model_impl(self.config, self.model_config) == "native"

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (their K/V were computed with other weights)."""
        self.block_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1 also moves the weights to host memory; level 2 discards them, to be
        refilled by `load_weights` after `wake_up`); see `fxrewrite.runtime.worker.sleep_mode`. A second
        call while asleep at that level or deeper does nothing; a deeper one (2 after 1) and a level other than
        the int 1 or 2 are ValueErrors. RuntimeError while requests are unfinished."""
        self._check_idle("sleep")
        self.reset_prefix_cache()
        self.model_runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed: `tags` among "weights", "kv_cache" (None: both), so the weights can
        come back and be updated before the KV cache is reallocated. Without a sleep: a no-op.
        ValueError naming an unknown tag."""
        unknown = [t for t in (tags or ()) if t not in ("weights", "kv_cache")]
        if unknown or (tags is not None and not isinstance(tags, (list, tuple))):
            raise UserInputError(f"wake_up: tags={tags!r}; expected a list of 'weights', 'kv_cache' (or None: both)")
        self.model_runner.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while any part (weights, KV cache) is asleep; after a full `wake_up` False, as vLLM reports it,
        even when a level-2 sleep's weights still await `load_weights` (requests are refused until then). With
        worker processes, every rank's status counts: RuntimeError naming the ranks when they disagree."""
        status = self.model_runner.sleep_status()
        return status is not None and bool(status[0])

    def _check_awake(self) -> None:
        status = self.model_runner.sleep_status()
        if status is None:
            return
        asleep, discarded = status
        if asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(asleep)} freed): call wake_up() first")
        if discarded:
            raise RuntimeError("the weights were discarded by sleep(level=2): call load_weights() first (every "
                               "parameter, in one call or in several with strict=False)")
