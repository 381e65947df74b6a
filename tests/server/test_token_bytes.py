"""OpenAI's logprob `bytes` for a token that holds part of a character: its raw bytes (byte-level BPE pieces,
SentencePiece "<0xNN>" pieces), so the bytes of a character's tokens join to its UTF-8; the text of such a token
is U+FFFD, whose own bytes said nothing (a fresh user's find)."""

from __future__ import annotations

import pytest

from fxrewrite.runtime.server.logprobs import token_bytes

TEXT = "𝔘𝔫𝔦 🫠 ǅ 𓀀 日本 é ok"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tokenizer(request, tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir(request.param))


def test_the_tokens_bytes_join_to_the_texts_utf8(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in t for t in texts), texts  # the text splits characters across tokens
    joined = b"".join(bytes(token_bytes(tokenizer, i, t)) for i, t in zip(ids, texts, strict=True))
    assert joined.decode("utf-8").strip() == TEXT.strip()


def test_whole_tokens_and_token_id_names_keep_their_texts_bytes(tokenizer):
    for i in tokenizer.encode("hello world", add_special_tokens=False):
        text = tokenizer.decode([i])
        assert token_bytes(tokenizer, i, text) == list(text.encode())
    assert token_bytes(tokenizer, 5, "token_id:5") == list(b"token_id:5")
