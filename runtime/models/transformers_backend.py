"""Serve a stock transformers model: built on meta, attention redirected to the paged cache."""

from __future__ import annotations

import logging

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM

from fxrewrite.compiler import optimize
from fxrewrite.errors import UnsupportedModelError
from fxrewrite.patterns.rotary import replace_length_dependent_rotary
from fxrewrite.runtime.model_files.positions import learned_position_offset
from fxrewrite.runtime.worker.attention import register_paged_attention

logger = logging.getLogger(__name__)


# transformers' own cache layout says what each layer keeps between steps; the paged cache holds keys and values only.
PAGED_CACHE_LAYERS = {"DynamicLayer", "DynamicSlidingWindowLayer"}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


# ALiBi adds a per-head linear bias to the attention scores, which the paged kernels do not compute: MPT always
# (transformers' MPT builds the bias unconditionally), Falcon when its config says `alibi` (BLOOM, also ALiBi, is
# refused by the load check: its attention does not call transformers' attention interface).
ALIBI_MODEL_TYPES = {"mpt"}


def check_attention_only(text_config) -> None:
    """UnsupportedModelError (a NotImplementedError) naming the layers when the model has layers that are not
    key/value attention (Mamba, linear attention, short convolutions: Qwen3-Next, Granite-4.0-H, Falcon-H1, Jamba,
    LFM2), read off the cache transformers would build for it (`DynamicCache(config=...)`) and the config's
    `layer_types`; or when its attention adds ALiBi position biases (MPT, Falcon with `alibi`)."""
    from transformers import DynamicCache

    if text_config.model_type in ALIBI_MODEL_TYPES or getattr(text_config, "alibi", False) is True:
        raise UnsupportedModelError(
            f"{text_config.model_type}: its attention adds ALiBi position biases, which fxrewrite's paged attention "
            "does not compute (rotary or learned position embeddings only); this model cannot be served here")
    kinds = {type(layer).__name__ for layer in DynamicCache(config=text_config).layers} - PAGED_CACHE_LAYERS
    kinds |= set(getattr(text_config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if kinds:
        raise UnsupportedModelError(
            f"{text_config.model_type}: layers of kind {', '.join(sorted(kinds))} keep state that fxrewrite's paged KV "
            "cache does not hold (only full and sliding-window attention is served)")


class TransformersForCausalLM(nn.Module):
    """Wraps an HF `*ForCausalLM` with the engine's model interface.

    forward(input_ids [T], positions [T]) -> hidden states [T, hidden]: the flattened tokens of all
    sequences run as one batch row with use_cache=False; attention goes to "fxrewrite_paged".
    compute_logits(hidden [S, hidden]) -> [S, vocab]: lm_head plus the final soft-capping / logit scaling read
    off the config (Gemma 2 `final_logit_softcapping`, Cohere `logit_scale`, Granite `logits_scaling`), checked
    once, on the first call's real hidden states, against the `*ForCausalLM`'s own forward; where they differ
    (HyperCLOVAX multiplies by `logits_scaling`, an LM head with a transform of its own), every later call runs
    that forward's head code (`logits_by_model_code`).
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        # RoBERTa-style embeddings number positions from padding_idx + 1 (transformers'
        # create_position_ids_from_input_ids, after fairseq's make_positions; vLLM's RoBERTa adds the same offset);
        # a padding token inside a prompt is numbered like any other, as in vLLM
        self.position_offset = learned_position_offset(hf_model.config.get_text_config())
        self.head_checked = False
        self.head_by_model_code = False

    @classmethod
    def from_config(cls, hf_config, dtype: torch.dtype, fusion: bool,
                    trust_remote_code: bool = False) -> TransformersForCausalLM:
        """Build with parameters on meta (computed buffers such as rotary inv_freq stay real); trust_remote_code:
        a config whose ``auto_map`` names the folder's own modeling code builds that (as transformers and vLLM do).
        UnsupportedModelError (a NotImplementedError) for a model with layers whose state the paged KV cache does
        not hold, ALiBi attention, or attention picked from a table of the model's own."""
        check_attention_only(hf_config.get_text_config())
        attn = register_paged_attention()
        with init_empty_weights(include_buffers=False):
            try:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn,
                                                         trust_remote_code=trust_remote_code)
            except KeyError as e:  # GPT-Neo: GPT_NEO_ATTENTION_CLASSES[config._attn_implementation]
                if e.args != (attn,):
                    raise
                raise UnsupportedModelError(
                    f"{hf_config.model_type}: its modeling code picks attention classes from a table of its own (no "
                    f"{attn!r} entry) instead of calling transformers' attention interface, so the paged KV cache "
                    "cannot be used; this model cannot be served by the transformers backend") from None
        # from_config leaves lm_head untied on meta; tie before materialising so one tensor is loaded.
        model.tie_weights()
        model.eval()
        if fusion:
            optimize(model)
        # Dynamic NTK / LongRoPE: transformers' module takes one length for the whole flattened step.
        replace_length_dependent_rotary(model, model.config.get_text_config())
        return cls(model)

    @property
    def attention_layer_indices(self) -> range:
        """Every decoder layer attends (check_attention_only refused the others); `load_check` checks each one's
        attention reaches the paged cache."""
        return range(self.config.get_text_config().num_hidden_layers)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model's learned position table holds after `position_offset` (None: no limit
        beyond the config's)."""
        table = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        return table - self.position_offset if self.position_offset and table else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        out = self.hf_model.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.head_by_model_code:
            return self.logits_by_model_code(hidden_states)
        if self.head_checked:
            return self.logits_from_config(hidden_states)
        self.head_checked = True
        return self.checked_logits(hidden_states)

    def checked_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The first call's logits: the config's head, unless the model's own head code gives others (or the output
        embeddings are narrower or wider than the hidden states: a head that projects first); then that code computes
        every later call's too."""
        weight = getattr(self.hf_model.get_output_embeddings(), "weight", None)
        if weight is not None and weight.shape[-1] != hidden_states.shape[-1]:  # RemBERT: 64 -> 1664 -> vocab
            self.head_by_model_code = True
            return self.logits_by_model_code(hidden_states)
        logits = self.logits_from_config(hidden_states)
        try:
            own = self.logits_by_model_code(hidden_states)
        except Exception as e:  # noqa: BLE001 - a forward this stand-in cannot drive: the config's head, as before
            logger.warning("%s: the LM head could not be checked against the model's own forward (%s: %s)",
                           type(self.hf_model).__name__, type(e).__name__, e)
            return logits
        if not same_logits(logits, own):
            logger.info("%s: the LM head's output differs from lm_head plus the config's logit scaling; "
                        "running the model's own head code", type(self.hf_model).__name__)
            self.head_by_model_code = True
            return own
        return logits

    def logits_from_config(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden_states)
        cfg = getattr(self.config, "get_text_config", lambda: self.config)()
        scale = getattr(cfg, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        divisor = getattr(cfg, "logits_scaling", None)
        if divisor is not None:
            logits = logits / divisor
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def logits_by_model_code(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The `*ForCausalLM.forward` with its decoder stack swapped for `hidden_states` [S, hidden]: whatever the
        model does after its last norm (a scaled or transformed LM head, soft-capping) runs as written."""
        model = self.hf_model
        prefix = model.base_model_prefix
        stack = model._modules[prefix]  # KeyError where the decoder stack is not the base_model_prefix child
        model._modules[prefix] = _GivenHiddenStates(hidden_states.unsqueeze(0))
        try:
            return model(use_cache=False, logits_to_keep=0).logits[0]
        finally:
            model._modules[prefix] = stack


class _GivenHiddenStates(nn.Module):
    """Stands in for a decoder stack: returns the hidden states it was given (every other output field: None)."""

    def __init__(self, hidden_states: torch.Tensor):
        super().__init__()
        self.hidden_states = hidden_states

    def forward(self, *args, **kwargs):
        return _StackOutput(self.hidden_states)

    @property
    def decoder(self) -> _GivenHiddenStates:
        """OPT's and BART's heads call ``self.model.decoder(...)``: the stand-in answers for its decoder too."""
        return self


class _StackOutput:
    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getitem__(self, index: int):
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str):  # past_key_values, hidden_states, router_logits, ...: not computed here
        return None


def same_logits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the dtype's rounding of the same formula (bf16 ~1e-2 relative, float32 ~1e-5)."""
    if a.shape != b.shape:
        return False
    tol = 1e-4 if a.dtype == torch.float32 else 2e-2
    return bool(((a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp_min(1e-6)).item())
