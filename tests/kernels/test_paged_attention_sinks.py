"""Attention sinks (GPT-OSS): the paged reference against transformers' own gpt_oss attention, the decode
(split-K, keys-major) and prefill kernels against the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxrewrite.kernels import paged_decode, paged_prefill
from fxrewrite.kernels.paged_attention import paged_attention_ref

# (cached tokens, query tokens): decode, chunked prefill / prefix hit, fresh prefill
MIXED = [(13, 1), (9, 6), (0, 11), (35, 7)]
DECODE = [(13, 1), (0, 1), (40, 1)]


def gpt_oss_attention(batch, sinks, scale, sliding_window=None):
    """transformers' gpt_oss `eager_attention_forward` per sequence (K/V read through the block table, an additive
    causal / window mask): the oracle. float64."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = nn.Module()
    module.sinks = nn.Parameter(sinks.double())
    module.num_key_value_groups = batch.query.shape[1] // batch.key_cache.shape[2]
    module.eval()
    bs, outs = batch.key_cache.shape[1], []
    for b in range(batch.seq_lens.shape[0]):
        seq_len = int(batch.seq_lens[b])
        q0, q1 = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        pos = torch.arange(seq_len)
        blocks = batch.block_tables[b].long()[pos // bs]
        k, v = (c[blocks, pos % bs].double().transpose(0, 1)[None] for c in (batch.key_cache, batch.value_cache))
        q_pos = pos[seq_len - (q1 - q0):]
        visible = pos[None] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None] > q_pos[:, None] - sliding_window
        mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))
        q = batch.query[q0:q1].double().transpose(0, 1)[None]
        out, _ = eager_attention_forward(module, q, k, v, mask[None, None], scale)
        outs.append(out[0])
    return torch.cat(outs)


def _sinks(num_heads, seed=0):
    # around the scores' own size, so the sinks take a visible share of each softmax
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("window", [None, 6])
def test_ref_matches_transformers_gpt_oss_attention(paged_batch, window):
    batch = paged_batch(MIXED, 4, 2, 16, 4, seed=7)
    sinks = _sinks(4)
    got = paged_attention_ref(*batch.args(), 0.25, window, None, sinks)
    want = gpt_oss_attention(batch, sinks, 0.25, window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    plain = paged_attention_ref(*batch.args(), 0.25, window)
    assert (got - plain).abs().max() > 0.05  # the sinks really change the output


@pytest.mark.parametrize("splits,window", [(1, None), (3, None), (3, 9)])
@pytest.mark.parametrize("keys_major", [False, True])
def test_decode_kernel_with_sinks_matches_ref(interpret, paged_batch, splits, window, keys_major):
    batch = paged_batch(DECODE, 4, 2, 16, 8, seed=1)
    sinks = _sinks(4, seed=1)
    want = paged_attention_ref(*batch.args(), 0.3, window, None, sinks)
    got = paged_decode.paged_decode_triton(*batch.args(), 0.3, window, None, sinks, block_n=16, num_splits=splits,
                                           single_split_len=0, keys_major=keys_major)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_kernel_with_sinks_matches_ref(interpret, paged_batch, window):
    batch = paged_batch(MIXED, 4, 2, 16, 4, seed=2)
    sinks = _sinks(4, seed=2)
    want = paged_attention_ref(*batch.args(), 0.3, window, None, sinks)
    got = paged_prefill.paged_prefill_triton(*batch.args(), 0.3, window, None, sinks, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sinks_of_the_wrong_shape_are_refused(paged_batch):
    batch = paged_batch(DECODE, 4, 2, 16, 8)
    with pytest.raises(ValueError, match=r"sinks shape \(2,\); expected \[Hq\] = \[4\]"):
        paged_attention_ref(*batch.args(), 0.3, None, None, torch.zeros(2))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_kernels_with_sinks_match_ref_gpu(cuda, paged_batch, window):
    """GPT-OSS-120B's attention shapes (64 query heads, 8 kv heads, head_dim 64), bf16."""
    sinks = _sinks(64, seed=3).cuda()
    for specs in ([(700, 1), (3000, 1), (5, 1)], [(0, 300), (500, 40), (1000, 1)]):
        batch = paged_batch(specs, 64, 8, 64, 16, torch.bfloat16, "cuda", seed=4)
        want = paged_attention_ref(*batch.args(), 0.125, window, None, sinks).float()
        run = paged_decode.paged_decode_triton if batch.max_query_len == 1 else paged_prefill.paged_prefill_triton
        got = run(*batch.args(), 0.125, window, None, sinks).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
