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


def _two_decodes(tokenizer, prompt_ids, output_ids, params) -> tuple[str, list[str]]:
    """The per-token text through the two-decode scheme alone (the stream disabled), the oracle of the stream."""
    seq = Sequence("o", list(prompt_ids), params)
    detok = IncrementalDetokenizer(tokenizer, seq)
    detok._backend = None
    pieces = []
    for token in output_ids:
        seq.append_token(token)
        pieces.append(detok.step())
    return seq.text, pieces


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "smollm2"])
def test_decode_stream_emits_what_the_two_decodes_emit(tiny_model_dir, family, skip_special_tokens):
    """tokenizers' DecodeStream (the per-token path of fast tokenizers) against the two-decode scheme, piece by piece:
    random token ids (byte-level pieces that split characters), special tokens among them, short and long prompts."""
    import random

    from transformers import AutoTokenizer

    from fxrewrite.runtime.engine.detokenizer import _plain_backend

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama", vocab=family) if family == "smollm2"
                                                  else tiny_model_dir("qwen3")))
    # The stream serves tokenizers whose decode is the backend's own (Qwen3's always; SmolLM2's from transformers
    # 5.25 on; 5.17 cleans up its spaces): the others keep transformers' decode, and must.
    plain = _plain_backend(tokenizer) is not None
    assert plain or family == "smollm2"
    special = sorted(tokenizer.all_special_ids)
    rng = random.Random(7)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for trial in range(12):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.choice([1, 3, 12]))]
        output = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer)) for _ in range(300)]
        want_text, want = _two_decodes(tokenizer, prompt, output, params)
        seq = Sequence("s", list(prompt), params)
        detok, got = IncrementalDetokenizer(tokenizer, seq), []
        for token in output:
            seq.append_token(token)
            got.append(detok.step())
        # the stream ran to the end (no fallback) exactly where the tokenizer is plain, unless the prompt ends inside
        # a character (then the two decodes, by design)
        primed_mid_char = tokenizer.decode(prompt[-5:], skip_special_tokens=skip_special_tokens).endswith("\ufffd")
        assert (detok._stream is not None and detok._backend is not None) == (plain and not primed_mid_char), trial
        assert got == want and seq.text == want_text, trial
    assert any(not p for p in want) and any("\ufffd" in tokenizer.decode([t]) for t in output)  # split characters


def test_a_failing_stream_hands_over_to_the_two_decodes_without_losing_text(tokenizer, monkeypatch):
    """On an error of DecodeStream (tokenizers raises "invalid prefix" in rare cases) the sequence goes on with the
    two decodes from the last emitted token: the whole text equals the two-decode scheme's."""
    import fxrewrite.runtime.engine.detokenizer as detokenizer

    class Failing:
        def __init__(self, stream, after):
            self.stream, self.calls, self.after = stream, 0, after

        def step(self, backend, token):
            self.calls += 1
            if self.calls > self.after:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(backend, token)

    real = detokenizer._decode_stream
    text = " naïve 🙂🦜 你好, ünïcödé ✓ and more words"
    output = tokenizer.encode(text)
    want_text, want = _two_decodes(tokenizer, tokenizer.encode("Say:"), output, SamplingParams())
    for after in range(len(output)):
        monkeypatch.setattr(detokenizer, "_decode_stream", lambda prefix, skip: Failing(real(prefix, skip), after))
        seq, pieces = stream(tokenizer, "Say:", text)
        assert pieces == want and seq.text == want_text == text, after


def test_a_prompt_ending_inside_a_character_leaves_its_tail_out_of_the_text(tokenizer):
    """Token-id prompts cut mid-character (a continuation cut by max_tokens, RL prompts): tokenizers' DecodeStream
    primed with such a tail emits the tail's text with its first piece (break-it finding: 'I love � receipt...');
    the text is the output's alone, as the two decodes give it."""
    ids = tokenizer.encode("I love 🎉", add_special_tokens=False)[:-1]
    assert tokenizer.decode(ids).endswith("\ufffd")
    output = tokenizer.encode(" a receipt and more", add_special_tokens=False)
    seq = Sequence("r", list(ids), SamplingParams())
    detok, pieces = IncrementalDetokenizer(tokenizer, seq), []
    for token in output:
        seq.append_token(token)
        pieces.append(detok.step())
    want_text, want = _two_decodes(tokenizer, ids, output, SamplingParams())
    assert pieces == want and seq.text == want_text == " a receipt and more"


def test_text_pieces_read_as_one_string():
    """Sequence.append_text keeps recent pieces unjoined: text, text_len and text_from read as the joined string
    at every length, across the joins every 64 pieces and after a stop string cuts the text."""
    import random

    rng, seq, expected = random.Random(0), Sequence("r", [1], SamplingParams()), ""
    for step in range(300):
        piece = "".join(rng.choice("ab\u00e9\u4e2d ") for _ in range(rng.randrange(0, 4)))
        seq.append_text(piece)
        expected += piece
        assert seq.text_len == len(expected)
        start = rng.randrange(0, len(expected) + 2)
        assert seq.text_from(start) == expected[start:], (step, start)
        if step % 37 == 0:
            assert seq.text == expected
        if step == 150:  # a cut (check_stop_strings' truncation), then appends again
            seq.text = expected = expected[:100]


def test_stop_strings_in_text_pieces_match_whole_string_search():
    """The stop-string search reads only the tail window of the pieces; on random texts it finds the same first
    match, and cuts at the same place, as a search of the whole string from the same start."""
    import random

    rng = random.Random(1)
    for trial in range(200):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        include = rng.random() < 0.5
        seq = Sequence("r", [1], SamplingParams(stop=stops, include_stop_str_in_output=include))
        text = ""
        while True:
            piece = "".join(rng.choice("abcx") for _ in range(rng.randrange(1, 4)))
            seq.append_text(piece)
            old = text
            text += piece
            found = [(i, s) for s in stops if (i := text.find(s, max(len(old) - len(s) + 1, 0))) != -1]
            hit = check_stop_strings(seq, len(piece))
            if not found:
                assert hit is None and seq.text == text, trial
                continue
            idx, stop = min(found, key=lambda f: f[0])  # the first match; at one position, the first stop listed
            assert hit == stop and seq.text == text[: idx + (len(stop) if include else 0)], (trial, text, stops)
            break
