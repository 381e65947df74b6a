"""Proving a very long prompt over the context length without tokenizing all of it.

A fast tokenizer holds about 180 bytes per token while it encodes (its Encoding's ids, offsets, token strings,
then the Python list): a 20 MB prompt of short words took 20 s and 3.5 GB before its 400 (a fresh user's find),
and one of ~120 MB would exhaust a 24 GB host. The server only needs to know such a prompt is too long, so
`encode_bounded` tokenizes a long text piece by piece and stops as soon as the pieces prove the count is over
the limit; a text that is not proven over is tokenized whole, exactly, as before.

Why pieces give a lower bound: the pieces are cut at whitespace, where the tokenizers' pre-tokenizers (GPT-2 /
Llama-3 regexes, Metaspace) already split words, so a piece's tokens are the whole text's tokens of that span but
for the words at the cut; `CUT_MARGIN` tokens per cut (plus the special tokens a piece may get) covers them.
"""

from __future__ import annotations

from typing import Any

PIECE_CHARS = 1 << 16
"""Characters per piece (cut back to the last whitespace inside it): 64 Ki, ~16 k tokens of English."""

CUT_MARGIN = 8
"""Tokens a cut may add to the pieces' sum over the whole text's count (words split at the cut, special tokens)."""


class PromptTooLong(Exception):
    """The prompt holds more than `at_least` tokens (a lower bound, proven over the limit it was checked
    against)."""

    def __init__(self, at_least: int):
        super().__init__(f"the prompt has more than {at_least} tokens")
        self.at_least = at_least


def encode_bounded(tokenizer: Any, text: str, limit: int, **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text, **kwargs)``, but a text longer than `limit` tokens may be refused early.

    A text of at most ``2 * PIECE_CHARS`` characters, or of at most 8 characters per allowed token, is encoded
    whole. A longer one is encoded in pieces of ~`PIECE_CHARS` characters; once the pieces' token counts, less
    `CUT_MARGIN` per piece, exceed `limit`, PromptTooLong(that lower bound) is raised; if they never do, the
    text is encoded whole (exact). limit: tokens (the server's max_model_len). Memory and time stay in
    proportion to the limit, not the text."""
    if len(text) <= max(2 * PIECE_CHARS, 8 * limit):
        return list(tokenizer.encode(text, **kwargs))
    counted, start = 0, 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
            end = cut if cut > start else end
        counted += len(tokenizer.encode(text[start:end], **kwargs)) - CUT_MARGIN
        if counted > limit:
            raise PromptTooLong(counted)
        start = end
    return list(tokenizer.encode(text, **kwargs))
