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


def test_final_decode_of_an_output_ending_mid_character_keeps_the_text_before_it(tokenizer):
    """A deferred decode (one call at the finish) of tokens ending inside a character gives the per-token text,
    not nothing (fresh-user finding: max_tokens cutting a character emptied the whole output)."""
    text = " naïve 🙂🦜 你好"
    ids = tokenizer.encode(text)
    for cut in range(1, len(ids) + 1):
        per_token = Sequence("r", tokenizer.encode("Say:"), SamplingParams())
        deferred = IncrementalDetokenizer(tokenizer, per_token)
        for token in ids[:cut]:
            per_token.append_token(token)
        deferred.step(final=True)
        streamed = Sequence("s", tokenizer.encode("Say:"), SamplingParams())
        incremental = IncrementalDetokenizer(tokenizer, streamed)
        for token in ids[:cut]:
            streamed.append_token(token)
            incremental.step()
        assert per_token.text == streamed.text, cut
        assert "\ufffd" not in per_token.text and text.startswith(per_token.text)
    assert any(tokenizer.decode(ids[:cut]).endswith("\ufffd") for cut in range(1, len(ids)))  # really cut mid-char


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
