"""`encode_bounded`: a very long prompt is proven over the context length from pieces, without tokenizing it
whole (a 20 MB prompt took 20 s and 3.5 GB of the server before its 400); anything not proven over is tokenized
exactly. The real Qwen3 tokenizer (byte-level BPE) and SmolLM2's."""

from __future__ import annotations

import pytest

from fxrewrite.runtime.server.prompt_bound import PIECE_CHARS, PromptTooLong, encode_bounded

TEXT = "The quick brown fox, naïve café owner, jumps over 12,345 lazy dogs.\n\tIndented  code();  # 日本語 🚀 "


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tokenizer(request, tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir(request.param))


def test_short_and_unproven_texts_are_tokenized_exactly(tokenizer):
    short = TEXT * 10
    assert encode_bounded(tokenizer, short, 16) == tokenizer.encode(short)  # short: whole, the caller checks it
    long = TEXT * (3 * PIECE_CHARS // len(TEXT))
    exact = tokenizer.encode(long)
    assert encode_bounded(tokenizer, long, len(exact)) == exact  # exactly at the limit: never refused
    assert encode_bounded(tokenizer, long, 10 * len(exact)) == exact


def test_a_long_text_over_the_limit_is_refused_with_a_lower_bound(tokenizer):
    long = TEXT * (5 * PIECE_CHARS // len(TEXT))
    exact = len(tokenizer.encode(long))
    with pytest.raises(PromptTooLong) as e:
        encode_bounded(tokenizer, long, 1000)
    assert 1000 < e.value.at_least <= exact and "more than" in str(e.value)
    # pieces cut with no whitespace at all (one long "word") still bound the count from below
    dense = "x9" * (3 * PIECE_CHARS)
    with pytest.raises(PromptTooLong) as e:
        encode_bounded(tokenizer, dense, 100)
    assert e.value.at_least <= len(tokenizer.encode(dense))


def test_the_bound_is_a_lower_bound_just_past_the_limit(tokenizer):
    """A text a little over the limit: refused (then the bound is below the exact count) or tokenized whole."""
    long = TEXT * (3 * PIECE_CHARS // len(TEXT))
    exact = len(tokenizer.encode(long))
    for limit in (exact - 1, exact - 50, exact // 2):
        try:
            ids = encode_bounded(tokenizer, long, limit)
        except PromptTooLong as e:
            assert limit < e.value.at_least <= exact
        else:
            assert len(ids) == exact
