"""Which MLP width a model's dense decoder layers hold, by transformers' rules for mixtures of experts: what the
tensor-parallel and FP8 block checks divide (`worker.executor.check_tp_divisible`, `model_files.quantization`)."""

from __future__ import annotations


def dense_mlp_width(text_config) -> int | None:
    """``intermediate_size`` when some decoder layer runs a dense MLP of that width; None for a mixture of experts
    whose every layer is sparse with its own expert width ``moe_intermediate_size`` (transformers' rules: Qwen-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq``), whose
    ``intermediate_size`` no layer holds. The expert widths are `moe_checks`' to check."""
    width = getattr(text_config, "intermediate_size", None)
    if getattr(text_config, "moe_intermediate_size", None) is None:
        return width
    experts = getattr(text_config, "num_experts", None) or getattr(text_config, "n_routed_experts", None)
    step = getattr(text_config, "decoder_sparse_step", 1) or 1
    layers = getattr(text_config, "num_hidden_layers", 0) or 0
    every_layer_sparse = (bool(experts) and not (getattr(text_config, "mlp_only_layers", None) or [])
                          and all((i + 1) % step == 0 for i in range(layers))
                          and not (getattr(text_config, "first_k_dense_replace", 0) or 0)
                          and (getattr(text_config, "moe_layer_freq", 1) or 1) == 1)
    return None if every_layer_sparse else width
