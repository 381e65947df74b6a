"""Forward context always resets; a step flattens to the right slots; no dense mask for our attention."""

import inspect

import pytest
import torch

from fxrewrite.runtime.worker.forward_context import forward_context, get_forward_context
from fxrewrite.runtime.engine.inputs import prepare_inputs
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.scheduler import ScheduledSeq
from fxrewrite.runtime.engine.sequence import Sequence


def test_context_is_reset_even_on_error():
    meta = object()
    with pytest.raises(KeyError):
        with forward_context(meta):
            assert get_forward_context() is meta
            raise KeyError("x")
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_prepare_inputs_flattens_decode_and_prefill_chunk():
    decode = Sequence("a", [5, 6, 7, 8, 9], SamplingParams())
    decode.block_table, decode.num_computed_tokens = [3, 1], 4
    chunk = Sequence("b", list(range(10, 20)), SamplingParams())
    chunk.block_table, chunk.num_computed_tokens = [0, 2], 2
    inputs = prepare_inputs([ScheduledSeq(decode, 1), ScheduledSeq(chunk, 4)], 4, torch.device("cpu"))
    assert inputs.input_ids.tolist() == [9, 12, 13, 14, 15]
    assert inputs.positions.tolist() == [4, 2, 3, 4, 5]
    md = inputs.attn_metadata
    assert md.slot_mapping.tolist() == [1 * 4 + 0, 0 * 4 + 2, 0 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert md.seq_lens.tolist() == [5, 6] and md.query_start_loc.tolist() == [0, 1, 5]
    assert md.block_tables.tolist() == [[3, 1], [0, 2]]
    assert md.max_query_len == 4 and md.max_seq_len == 6
    assert inputs.logits_indices.tolist() == [0] and inputs.sample_seqs == [decode]  # chunk not at its end


def test_transformers_builds_no_dense_mask_for_paged_attention():
    from transformers import Qwen3Config
    from transformers.masking_utils import create_causal_mask

    from fxrewrite.runtime.worker.attention import register_paged_attention

    config = Qwen3Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    config._attn_implementation = register_paged_attention()
    embeds = torch.zeros(1, 6, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 7]])
    # the cache argument's name: past_key_values up to transformers 5.17's era, cache in later 5.x
    cache_kw = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, position_ids=positions,
                              **{cache_kw: None})
    assert mask is None
