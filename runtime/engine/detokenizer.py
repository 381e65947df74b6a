"""Incremental detokenization and stop-string handling."""

from __future__ import annotations

from fxrewrite.runtime.engine.sequence import Sequence

# Prompt tokens decoded along with the first output tokens, so that a leading space or a byte-level
# character split across the prompt/output boundary comes out as it would in a full decode.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Appends the text of newly generated tokens to `seq.text`, never splitting a multi-byte character.

    vLLM's scheme: decode tokens[prefix_offset:read_offset] and tokens[prefix_offset:]; the new text is
    the difference. While the tail decodes to U+FFFD (an incomplete UTF-8 sequence), nothing is emitted.
    """

    def __init__(self, tokenizer, seq: Sequence):
        self.tokenizer = tokenizer
        self.seq = seq
        self.read_offset = seq.num_prompt_tokens
        self.prefix_offset = max(seq.num_prompt_tokens - _PROMPT_CONTEXT_TOKENS, 0)
        params = seq.sampling_params
        self.decode_kwargs = {
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
        }
        self._backend = _plain_backend(tokenizer)
        self._stream = None  # tokenizers' DecodeStream, made at the first per-token step
        self._fed = 0  # tokens given to it
        if self._backend is not None:  # same text, without transformers' per-call argument handling (~4x faster)
            backend, skip = self._backend, params.skip_special_tokens
            self._decode = lambda token_ids: backend.decode(token_ids, skip_special_tokens=skip)

    def _decode(self, token_ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(token_ids, **self.decode_kwargs)
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.decode_kwargs["skip_special_tokens"])

    deferred = False
    """True: the engine calls `step` once when the sequence finishes, not per token (a request that only
    wants its final output and has no stop strings: the same text, without two decodes per token)."""

    def step(self, end: int | None = None, final: bool = False) -> str:
        """Decode what was appended since the last call, up to token index `end` (all when None); returns
        the new text (may be empty). `final` (the sequence's last call): a tail that is an incomplete character
        is dropped and the text before it emitted, as the per-token calls would have emitted it (a deferred
        decode of a whole output ending mid-character must not lose all of it)."""
        if end is None and self._backend is not None:
            new_text = self._stream_step()
            if new_text is not None:
                return new_text
        tokens = self.seq.token_ids if end is None else self.seq.token_ids[:end]
        prefix_text = self._decode(tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(tokens[self.prefix_offset :])
        if final:
            full_text = full_text.rstrip("\ufffd")
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        self.seq.append_text(new_text)
        return new_text

    def _stream_step(self) -> str | None:
        """`step` through tokenizers' `DecodeStream` (the same scheme in Rust: one call a token, ~5x faster than two
        decodes), primed with tokens[prefix_offset:read_offset] as the two decodes are. None: no stream here (a
        tokenizers release without its priming argument, or a prompt ending inside a character); on an error of the stream ("invalid prefix"), the text
        it emitted is kept and this sequence goes on with the two decodes from the last emitted token."""
        if self._stream is None:
            prefix = self.seq.token_ids[self.prefix_offset : self.read_offset]
            # A primed prefix ending inside a character (a prompt cut mid-character) is emitted by the stream with
            # its first piece: such a sequence keeps the two decodes.
            if not self._decode(prefix).endswith("\ufffd"):
                self._stream = _decode_stream(prefix, self.seq.sampling_params.skip_special_tokens)
            self._fed = self.read_offset
            if self._stream is None:
                self._backend = None
                return None
        tokens, stream, new_text = self.seq.token_ids, self._stream, ""
        try:
            while self._fed < len(tokens):
                piece = stream.step(self._backend, tokens[self._fed])
                self._fed += 1
                if piece is not None:  # the offsets the two decodes would now hold
                    new_text += piece
                    self.prefix_offset, self.read_offset = self.read_offset, self._fed
        except Exception:
            self._backend = None
        if new_text:
            self.seq.append_text(new_text)
        return new_text if self._backend is not None else new_text + self.step()


def _decode_stream(prefix: list[int], skip_special_tokens: bool):
    """A `tokenizers.decoders.DecodeStream` primed with `prefix` (its text counts as already read); None where
    tokenizers lacks it or its `ids` argument (older releases)."""
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=prefix, skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


def _plain_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose decode is exactly the backend's
    (decode/_decode not overridden, no clean_up_tokenization_spaces); None otherwise. Fast tokenizers
    ignore spaces_between_special_tokens, so only skip_special_tokens matters."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or cls.decode is not TokenizersBackend.decode
        or cls._decode is not TokenizersBackend._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    return getattr(tokenizer, "_tokenizer", None)


def check_stop_strings(seq: Sequence, new_text_len: int) -> str | None:
    """If a stop string appears in the text added last, cut the text there and return the stop string.

    The text is cut right before the stop string (or right after it with include_stop_str_in_output);
    only the tail that could contain a new match is searched. As in vLLM's detokenizer, nothing is searched
    while the sequence has at most min_tokens output tokens: the text of the first min_tokens tokens never
    ends it (a stop string may still begin there and end in a later token's text).
    """
    params = seq.sampling_params
    if not params.stop_strings or new_text_len == 0:
        return None
    if params.min_tokens and seq.num_output_tokens <= params.min_tokens:
        return None
    end = seq.text_len
    window = max(end - new_text_len - max(len(stop) for stop in params.stop_strings) + 1, 0)
    tail = seq.text_from(window)  # only the tail that can hold a new match (the whole text is not joined)
    best: tuple[int, str] | None = None
    for stop in params.stop_strings:
        idx = tail.find(stop, max(end - new_text_len - len(stop) + 1, 0) - window)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    seq.text = seq.text[: window + idx + (len(stop) if params.include_stop_str_in_output else 0)]
    return stop


def no_text(token_id: int) -> None:
    return None  # SamplingParams(detokenize=False): logprob entries without decoded_token


def visible_len(seq: Sequence) -> int:
    """Characters of `seq.text` to report: while running, the tail that could still become a stop string is held
    back (vLLM's buffer), so streamed text never has to be taken back."""
    params = seq.sampling_params
    if seq.is_finished or not params.stop_strings or params.include_stop_str_in_output:
        return seq.text_len
    return max(seq.text_len - max(len(s) for s in params.stop_strings) + 1, 0)


def visible_text(seq: Sequence) -> str:
    """seq.text up to `visible_len`."""
    return seq.text[: visible_len(seq)]


def check_stop_token(seq: Sequence, token_id: int, eos_token_ids: set[int]):
    """(finish_reason, stop_reason) from EOS and stop token ids; (None, None) if neither (stop strings
    are checked after detokenizing). Nothing stops before min_tokens."""
    params = seq.sampling_params
    if params.min_tokens and len(seq.token_ids) - seq.num_prompt_tokens < params.min_tokens:  # num_output_tokens
        return None, None
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop", None
    if token_id in params.stop_token_ids:
        return "stop", token_id
    return None, None
