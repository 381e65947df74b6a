"""Engine logprobs (`list[dict[token_id, Logprob]]`, one dict per generated token) in OpenAI's shapes.

`as_ids` (vLLM's `return_tokens_as_token_ids`) names each token "token_id:<id>" instead of its text, so a client
recovers the exact ids (a text that is not valid UTF-8 on its own, or that several ids share, cannot say them)."""

from __future__ import annotations

import functools
import re
from typing import Any

from fxrewrite.runtime.server.protocol_responses import ChatLogProbs, CompletionLogProbs, TokenLogprob, TopLogprob


def _token_text(tokenizer: Any, token_id: int, entry: Any, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    if entry is not None and getattr(entry, "decoded_token", None) is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """OpenAI's `bytes` of a token whose text is `text`: its UTF-8 encoding, except for a token holding part of a
    character (its text decodes to U+FFFD), whose raw bytes come from its piece: a byte-level BPE piece through
    GPT-2's byte-to-character map, or a SentencePiece "<0xNN>" piece, so a client can join split characters (the
    replacement character's bytes said nothing; a fresh user's find)."""
    if "\ufffd" not in text or text.startswith("token_id:"):
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and (match := _BYTE_PIECE.fullmatch(piece)):
        return [int(match.group(1), 16)]
    # A piece of byte-level characters only (the tokenizer's decoder may wrap ByteLevel in a Sequence: transformers
    # 5.17 converts SmolLM2's so); another tokenizer's partial character is a "<0xNN>" piece, handled above.
    decoder = _byte_level_decoder()
    if isinstance(piece, str) and piece and all(c in decoder for c in piece):
        return [decoder[c] for c in piece]
    return list(text.encode("utf-8"))


def _ranked(step: dict, num_top: int) -> list[tuple[int, Any]]:
    return sorted(step.items(), key=lambda kv: -kv[1].logprob)[:num_top]


def _top(tokenizer: Any, step: dict, num_top: int, as_ids: bool = False) -> list[tuple[str, float]]:
    """The `num_top` most likely tokens of one step as (text, logprob), best first."""
    return [(_token_text(tokenizer, tid, lp, as_ids), float(lp.logprob)) for tid, lp in _ranked(step, num_top)]


def _top_with_token(tokenizer: Any, step: dict, num_top: int, token_id: int, as_ids: bool) -> dict[str, float]:
    """Completions' top_logprobs of one position: the `num_top` most likely tokens plus the position's
    actual token (sampled or prompt) when it is not among them, as OpenAI and vLLM return them (so
    logprobs=0 gives {token: logprob}, not null)."""
    top = dict(_top(tokenizer, step, num_top, as_ids))
    entry = step.get(token_id)
    if entry is not None:
        top.setdefault(_token_text(tokenizer, token_id, entry, as_ids), float(entry.logprob))
    return top


def _steps(choice: Any, tok_start: int, tok_end: int):
    """(token_id, {token_id: Logprob}) for the generated tokens in [tok_start, tok_end)."""
    logprobs = choice.logprobs or ()
    for j in range(tok_start, min(tok_end, len(logprobs))):
        yield choice.token_ids[j], logprobs[j]


def completion_logprobs(tokenizer: Any, choice: Any, tok_start: int, tok_end: int, num_top: int,
                        text_offset: int = 0, as_ids: bool = False) -> CompletionLogProbs | None:
    """Legacy-completions logprobs of tokens [tok_start, tok_end); offsets count from `text_offset`."""
    if choice.logprobs is None:
        return None
    out = CompletionLogProbs()
    offset = text_offset
    for token_id, step in _steps(choice, tok_start, tok_end):
        entry = step.get(token_id)
        text = _token_text(tokenizer, token_id, entry)
        out.tokens.append(_token_text(tokenizer, token_id, entry, as_ids))
        out.token_logprobs.append(float(entry.logprob) if entry is not None else None)
        out.top_logprobs.append(_top_with_token(tokenizer, step, num_top, token_id, as_ids))
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: Any, choice: Any, tok_start: int, tok_end: int,
                  num_top: int, as_ids: bool = False) -> ChatLogProbs | None:
    """Chat-completions logprobs (`content` list) of tokens [tok_start, tok_end)."""
    if choice.logprobs is None:
        return None
    content = []
    for token_id, step in _steps(choice, tok_start, tok_end):
        entry = step.get(token_id)
        text = _token_text(tokenizer, token_id, entry, as_ids)
        top = []
        for tid, lp in _ranked(step, num_top):
            t = _token_text(tokenizer, tid, lp, as_ids)
            top.append(TopLogprob(token=t, logprob=float(lp.logprob), bytes=token_bytes(tokenizer, tid, t)))
        content.append(TokenLogprob(token=text, logprob=float(entry.logprob) if entry is not None else -9999.0,
                                    bytes=token_bytes(tokenizer, token_id, text), top_logprobs=top))
    return ChatLogProbs(content=content)


def echo_logprobs(tokenizer: Any, prompt_token_ids: tuple[int, ...], prompt_logprobs: tuple | None,
                  num_top: int, as_ids: bool = False) -> CompletionLogProbs:
    """Legacy-completions logprobs of the prompt itself (echo): the first token has none (None), each
    later one its logprob given the tokens before it, as lm-eval's loglikelihood requests read them."""
    out = CompletionLogProbs()
    offset = 0
    for j, token_id in enumerate(prompt_token_ids):
        step = prompt_logprobs[j] if prompt_logprobs is not None else None
        entry = step.get(token_id) if step else None
        text = _token_text(tokenizer, token_id, entry)
        out.tokens.append(_token_text(tokenizer, token_id, entry, as_ids))
        out.token_logprobs.append(float(entry.logprob) if entry is not None else None)
        out.top_logprobs.append(_top_with_token(tokenizer, step, num_top, token_id, as_ids) if step else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def concat_logprobs(first: CompletionLogProbs, second: CompletionLogProbs | None) -> CompletionLogProbs:
    """`first` then `second` (its offsets already counted from the end of `first`'s text)."""
    if second is None:
        return first
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens, top_logprobs=first.top_logprobs + second.top_logprobs)
