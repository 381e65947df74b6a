"""Where a model's own code numbers positions from, read off its transformers modeling module."""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def learned_position_offset(text_config: PretrainedConfig) -> int:
    """padding_idx + 1 where the model's transformers code numbers positions from its padding index (RoBERTa-style
    embeddings with `create_position_ids_from_input_ids` in its modeling module: RoBERTa's 514 position entries hold
    512 tokens), else 0. The serving backend adds it to the positions it passes; the derived max_model_len is the
    table less it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    pad = getattr(text_config, "pad_token_id", None)
    try:
        module = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)].__module__]
    except (KeyError, ValueError, ImportError):  # not a causal LM transformers knows (or cannot import)
        return 0
    numbered = any(callable(getattr(obj, "create_position_ids_from_input_ids", None))
                   for obj in vars(module).values() if inspect.isclass(obj))
    return pad + 1 if numbered and isinstance(pad, int) else 0
