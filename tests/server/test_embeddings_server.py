"""POST /v1/embeddings on `fxrewrite serve MODEL --runner pooling` through the `openai` client: float and
base64 encodings agree with `LLM.embed`-style last-token pooling (normalised), usage counts prompt
tokens, every OpenAI input shape works; bad input and a generate-only server answer 400."""

from __future__ import annotations

import base64
import threading
import time

import numpy as np
import pytest

from tests.ports import free_port
from tests.server.conftest import API_KEY, MODEL_NAME, STARTUP_TIMEOUT_S, ServerHandle

MAX_LEN = 64


@pytest.fixture(scope="module")
def pooling_server(tiny_model_dir):
    import uvicorn

    from fxrewrite.cli import build_parser
    from fxrewrite.commands.serve import build_server_app

    port = free_port()
    args = build_parser().parse_args([
        "serve", str(tiny_model_dir("qwen3")), "--port", str(port), "--api-key", API_KEY, "--runner", "pooling",
        "--served-model-name", MODEL_NAME, "--model-impl", "native", "--max-model-len", str(MAX_LEN),
        "--kv-cache-memory-bytes", "1M", "--dtype", "float32",
    ])
    engine, app = build_server_app(args)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "pooling server did not start"
        time.sleep(0.05)
    yield ServerHandle(f"http://127.0.0.1:{port}", engine, app, max_model_len=MAX_LEN)
    uv.should_exit = True
    thread.join(timeout=15)


def _direct(model_dir, prompts: list[list[int]]) -> list[np.ndarray]:
    """The offline path the server must match: `LLM.embed` on its own engine with the server's settings (the
    server's engine is stepped by its own loop; a test stepping it too could take the other's outputs)."""
    from fxrewrite.runtime.llm import LLM

    llm = LLM(str(model_dir), runner="pooling", model_impl="native", max_model_len=MAX_LEN, kv_cache_memory_bytes=2**20,
              dtype="float32")
    return [np.asarray(o.outputs.embedding, dtype=np.float32) for o in llm.embed(prompts, use_tqdm=False)]


def test_embeddings_float_and_base64(pooling_server, tiny_model_dir):
    client = pooling_server.client()
    texts = ["hello world", "a longer sentence about embeddings"]
    floats = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.object == "list"
    tokenizer = pooling_server.engine.tokenizer
    ids = [tokenizer.encode(t) for t in texts]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    with pooling_server.http() as http:  # raw base64, as OpenAI encodes it (little-endian float32)
        raw = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    direct = _direct(tiny_model_dir("qwen3"), ids)
    assert len(floats.data) == len(raw["data"]) == len(direct) == len(texts)
    assert [d["index"] for d in raw["data"]] == [0, 1]
    for d, b, want in zip(floats.data, raw["data"], direct, strict=True):
        vector = np.asarray(d.embedding, dtype=np.float32)
        assert vector.shape == (pooling_server.engine.model_config.hidden_size,)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-5
        np.testing.assert_allclose(vector, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4"), vector)
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0])  # token ids, and list of token ids
    many = client.embeddings.create(model=MODEL_NAME, input=ids)
    np.testing.assert_allclose(one.data[0].embedding, floats.data[0].embedding, rtol=1e-5, atol=1e-6)
    assert len(one.data) == 1 and len(many.data) == 2 and one.usage.prompt_tokens == len(ids[0])


def test_normalize_false_gives_the_raw_embedding(pooling_server, tiny_model_dir):
    """vLLM's `normalize` field (was ignored with a log line; a fresh user's find): false gives the pooled hidden
    state itself, the normalised vector times its norm."""
    with pooling_server.http() as http:
        raw = http.post("/v1/embeddings", json={"input": "hello world", "normalize": False}).json()
        unit = http.post("/v1/embeddings", json={"input": "hello world", "normalize": True}).json()
        bad = http.post("/v1/embeddings", json={"input": "hello world", "normalize": "no"})
    raw, unit = (np.asarray(r["data"][0]["embedding"], dtype=np.float32) for r in (raw, unit))
    norm = np.linalg.norm(raw)
    assert abs(norm - 1.0) > 1e-3 and abs(np.linalg.norm(unit) - 1.0) < 1e-5
    np.testing.assert_allclose(raw / norm, unit, rtol=1e-5, atol=1e-6)
    assert bad.status_code == 400 and "normalize" in bad.text


def test_matryoshka_dimensions(pooling_server, monkeypatch):
    """`dimensions` on a model whose config lists matryoshka_dimensions (`--hf-overrides`, as vLLM): the raw
    embedding's first values, normalised after the cut; a size not listed is a 400 (every size was refused)."""
    monkeypatch.setattr(pooling_server.engine.model_config.hf_config, "matryoshka_dimensions", [16],
                        raising=False)
    with pooling_server.http() as http:
        raw = http.post("/v1/embeddings", json={"input": "hello world", "normalize": False}).json()
        cut = http.post("/v1/embeddings", json={"input": "hello world", "dimensions": 16,
                                                "encoding_format": "base64"}).json()
        bad = http.post("/v1/embeddings", json={"input": "hello world", "dimensions": 8})
    head = np.asarray(raw["data"][0]["embedding"], dtype=np.float32)[:16]
    got = np.frombuffer(base64.b64decode(cut["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, head / np.linalg.norm(head), rtol=1e-5, atol=1e-6)
    assert bad.status_code == 400 and "only supports [16] matryoshka dimensions" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "dimensions"


def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens(pooling_server):
    """vLLM's `truncate_prompt_tokens`: each input's last k tokens are embedded (-1: the last max_model_len, so an
    input over the context is embedded rather than refused)."""
    long_ids = list(range(1, MAX_LEN + 6))
    with pooling_server.http() as http:
        cut = http.post("/v1/embeddings", json={"input": [long_ids, [7, 8, 9]], "truncate_prompt_tokens": 2}).json()
        tail = http.post("/v1/embeddings", json={"input": [long_ids[-2:], [8, 9]]}).json()
        whole = http.post("/v1/embeddings", json={"input": long_ids, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 4 and whole["usage"]["prompt_tokens"] == MAX_LEN, (cut, whole)
    assert len(cut["data"]) == len(tail["data"]) == 2 and len(whole["data"]) == 1
    for got, want in zip(cut["data"], tail["data"], strict=True):
        np.testing.assert_allclose(got["embedding"], want["embedding"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body, status, words", [
    ({"input": []}, 400, "input is empty"),
    ({"input": [[]]}, 400, "input is empty"),
    ({"input": ["ok", ""]}, 400, "input[1] is empty"),
    ({"input": list(range(1, MAX_LEN + 6))}, 400, f"has {MAX_LEN + 5} tokens"),
    ({"input": [10**9]}, 400, "input: token id 1000000000 is out of range"),
    ({"input": ["ok", "many words " * 30_000]}, 400, "input[1] has more than "),
    ({"input": "x", "dimensions": 8}, 400, "dimensions=8 is not supported: this model does not support matryoshka"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "model": "nope"}, 404, "nope"),
])
def test_bad_embedding_requests(pooling_server, body, status, words):
    with pooling_server.http() as http:
        r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert pooling_server.all_blocks_free()


def test_pooling_server_refuses_generation(pooling_server):
    with pooling_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "does not support the Completions API" in r.json()["error"]["message"]


def test_generate_server_refuses_embeddings(server):
    with server.http() as http:
        r = http.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400, r.text
    assert "--runner pooling" in r.json()["error"]["message"]


def test_embedding_response_id_takes_the_x_request_id(pooling_server):
    """As vLLM names it (`embd-<X-Request-Id>`); a new id otherwise."""
    with pooling_server.http() as http:
        given = http.post("/v1/embeddings", json={"input": "hi"}, headers={"X-Request-Id": "trace-9"}).json()["id"]
        fresh = http.post("/v1/embeddings", json={"input": "hi"}).json()["id"]
    assert given == "embd-trace-9" and fresh.startswith("embd-") and fresh != "embd-trace-9"


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]


def _template_ids(tokenizer, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("generation_prompt", [None, True])
def test_messages_embed_the_chat_template_rendering(pooling_server, generation_prompt):
    """vLLM's EmbeddingChatRequest: `messages` instead of `input`, rendered by the chat template (no generation
    prompt by default there), embed exactly as `input` holding the rendered text's token ids."""
    tokenizer = pooling_server.engine.tokenizer
    ids = _template_ids(tokenizer, add_generation_prompt=bool(generation_prompt))
    body = {"messages": MESSAGES} | ({} if generation_prompt is None else {"add_generation_prompt": True})
    with pooling_server.http() as http:
        chat = http.post("/v1/embeddings", json=body)
        plain = http.post("/v1/embeddings", json={"input": ids}).json()
    assert chat.status_code == 200, chat.text
    chat = chat.json()
    assert chat["usage"]["prompt_tokens"] == len(ids) == plain["usage"]["prompt_tokens"]
    assert len(chat["data"]) == 1 and chat["id"].startswith("embd-")
    np.testing.assert_allclose(chat["data"][0]["embedding"], plain["data"][0]["embedding"], rtol=1e-5, atol=1e-6)


def test_messages_through_the_openai_client(pooling_server):
    """vLLM's documented way: `messages` in the body of client.embeddings.create(extra_body=...)."""
    ids = _template_ids(pooling_server.engine.tokenizer)
    client = pooling_server.client()
    out = client.post("/embeddings", body={"model": MODEL_NAME, "messages": MESSAGES, "encoding_format": "float"},
                      cast_to=object)
    assert out["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "messages": MESSAGES}, "messages", "either input or messages, not both"),
    ({}, "input", "input is required"),
    ({"encoding_format": "float"}, "input", "input is required"),
    ({"messages": []}, "messages", "messages"),
    ({"input": "hi", "add_generation_prompt": True}, "add_generation_prompt", "applies to messages only"),
    ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template", "--trust-request-chat-template"),
    ({"messages": [{"role": "user", "content": "many words " * 30_000}]}, "messages", "messages has more than"),
    ({"messages": MESSAGES, "add_special_tokens": "yes"}, "add_special_tokens", "add_special_tokens"),
])
def test_bad_messages_requests(pooling_server, body, param, words):
    with pooling_server.http() as http:
        r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert pooling_server.all_blocks_free()
