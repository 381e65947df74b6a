"""Mixture-of-experts settings checked before any worker starts (clear errors, vLLM's flag names)."""

from __future__ import annotations

from fxrewrite.errors import UserInputError


def moe_sizes(text_config) -> tuple[int | None, int | None, int | None]:
    """(num_experts, num_experts_per_tok, moe intermediate size) of a transformers config, None when absent.

    The expert count is ``num_experts`` (Qwen-MoE, OLMoE) or ``num_local_experts`` (Mixtral); the
    per-expert width ``moe_intermediate_size`` when the model has one, else ``intermediate_size``.
    """
    experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    top_k = getattr(text_config, "num_experts_per_tok", None)
    width = getattr(text_config, "moe_intermediate_size", None) or getattr(text_config, "intermediate_size", None)
    if not isinstance(experts, int) or experts <= 0:
        return None, None, None
    return experts, top_k, width


def check_moe_parallel(model_config, config) -> None:
    """ValueError naming the value when an MoE model cannot run as configured:
    top-k above the expert count; with ``enable_expert_parallel``, an expert count that
    ``tensor_parallel_size`` does not divide; without it, an expert width that it does not divide; either way,
    a shared expert width (Qwen2-MoE's ``shared_expert_intermediate_size``) that it does not divide.
    ``enable_expert_parallel`` on a model without experts is an error too."""
    experts, top_k, width = moe_sizes(model_config.hf_text_config)
    tp = config.tensor_parallel_size
    dp = getattr(config, "data_parallel_size", 1)
    ep = tp * dp  # under DP x EP the experts are split over every replica's ranks
    if experts is None:
        if config.enable_expert_parallel:
            raise UserInputError("enable_expert_parallel=True but the model has no experts "
                             f"(architectures {model_config.architectures})")
        return
    if isinstance(top_k, int) and not 1 <= top_k <= experts:
        raise UserInputError(f"num_experts_per_tok={top_k} (top-k) must be between 1 and the number of experts "
                         f"({experts})")
    if config.enable_expert_parallel and experts % ep:
        sizes = f"tensor_parallel_size={tp}" if dp == 1 else f"data_parallel_size={dp} x tensor_parallel_size={tp}"
        raise UserInputError(f"enable_expert_parallel: the expert count {experts} is not divisible by the expert-"
                             f"parallel size {ep} ({sizes})")
    if not config.enable_expert_parallel and isinstance(width, int) and width % tp:
        raise UserInputError(f"tensor_parallel_size={tp} must divide the experts' intermediate size {width} "
                         "(or pass enable_expert_parallel=True)")
    shared = getattr(model_config.hf_text_config, "shared_expert_intermediate_size", None)
    if isinstance(shared, int) and shared % tp:  # a dense gated MLP, column-split over TP even under EP
        raise UserInputError(f"tensor_parallel_size={tp} must divide the shared expert's intermediate size "
                             f"shared_expert_intermediate_size={shared}")
