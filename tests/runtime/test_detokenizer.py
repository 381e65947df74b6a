"""Incremental detokenization never splits a multi-byte character; stop strings cut exactly."""

import pytest

from fxrewrite.runtime.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.sequence import Sequence


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))


def stream(tokenizer, prompt, text, **params):
    seq = Sequence("r", tokenizer.encode(prompt), SamplingParams(**params))
    detok, pieces = IncrementalDetokenizer(tokenizer, seq), []
    for token in tokenizer.encode(text):
        seq.append_token(token)
        pieces.append(detok.step())
    return seq, pieces


def test_multibyte_characters_are_never_split(tokenizer):
    text = " naïve 🙂🦜 你好, ünïcödé ✓"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the text really splits characters
    seq, pieces = stream(tokenizer, "Say:", text)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == seq.text == text


def test_stop_string_cuts_text_exactly(tokenizer):
    seq, _ = stream(tokenizer, "Count:", " one two three four", stop=["three"])
    assert check_stop_strings(seq, len(seq.text)) == "three"
    assert seq.text == " one two "
    seq, _ = stream(tokenizer, "Count:", " one two three four", stop="two", include_stop_str_in_output=True)
    assert check_stop_strings(seq, len(seq.text)) == "two" and seq.text == " one two"


def test_stop_string_spanning_tokens_found_in_tail(tokenizer):
    seq = Sequence("r", [1], SamplingParams(stop=["ab"]))
    seq.text = "xxa"
    assert check_stop_strings(seq, 1) is None
    seq.text += "bcd"
    assert check_stop_strings(seq, 3) == "ab" and seq.text == "xx"


def test_stop_strings_wait_past_min_tokens():
    """vLLM's rule: with min_tokens, stop strings are searched only once the sequence has more than min_tokens
    tokens, so the min_tokens-th token's text cannot stop it; the next token's can (even one that completes a
    stop string begun earlier)."""
    seq = Sequence("r", [1], SamplingParams(stop=["ab"], min_tokens=2))
    seq.append_token(5)
    seq.text = "xa"
    assert check_stop_strings(seq, 2) is None
    seq.append_token(6)
    seq.text += "b"  # the 2nd token: "ab" is complete, but 2 <= min_tokens
    assert check_stop_strings(seq, 1) is None and seq.text == "xab"
    seq.append_token(7)
    seq.text += "yab"
    assert check_stop_strings(seq, 3) == "ab" and seq.text == "xaby"
