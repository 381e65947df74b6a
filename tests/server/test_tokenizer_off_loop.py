"""Prompt tokenization runs off the event loop (fresh-8 F12), a request's own chat_template (F21), and
--max-log-len's cut of the logged token ids (F19)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

SLOW_MARK = "slowslow"
SLOW_S = 3.0


@pytest.fixture
def slow_tokenizer(server, monkeypatch):
    """The server's tokenizer, whose encode takes SLOW_S seconds for a text holding SLOW_MARK (a stand-in
    for a 30 MB prompt) and records the thread of every call."""
    tok = server.engine.tokenizer
    original = tok.encode
    started, threads = threading.Event(), []

    def encode(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        if isinstance(text, str) and SLOW_MARK in text:
            started.set()
            time.sleep(SLOW_S)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    return started, threads


def test_health_answers_while_a_long_prompt_is_tokenized(server, slow_tokenizer):
    started, _ = slow_tokenizer
    prompt = f"{SLOW_MARK} " + "a " * 3000  # > max_model_len tokens: the usual 400 once tokenized
    result = {}

    def post():
        with server.http() as http:
            result["response"] = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})

    poster = threading.Thread(target=post)
    poster.start()
    assert started.wait(10), "the slow prompt never reached the tokenizer"
    t0 = time.monotonic()
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert time.monotonic() - t0 < SLOW_S / 3, "/health waited for the tokenizer"
    poster.join(20)
    response = result["response"]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"maximum context length is {server.max_model_len} tokens" in error["message"]
    assert "your prompt has 300" in error["message"]  # the exact count: 3001 or so tokens


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_huge_prompt_is_refused_without_tokenizing_it_whole(server, slow_tokenizer, route):
    """A prompt of 2 M characters (a fresh user's 20 MB one took 20 s and 3.5 GB): proven over the context from its
    first pieces, so no call tokenizes the whole text; the 400 gives the lower bound."""
    _, threads = slow_tokenizer
    prompt = "many words " * 200_000
    calls = []
    tok = server.engine.tokenizer
    encode = tok.encode
    tok.encode = lambda text, *a, **k: (calls.append(len(text)), encode(text, *a, **k))[1]
    body = {"prompt": prompt} if route == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]}
    t0 = time.monotonic()
    with server.http() as http:
        response = http.post(route, json=body | {"max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {server.max_model_len} tokens. However, your prompt has more than " \
        in error["message"]
    assert calls and max(calls) < 100_000 and time.monotonic() - t0 < 10, calls


def test_every_handler_tokenizes_in_the_one_tokenizer_thread(server, slow_tokenizer):
    _, threads = slow_tokenizer
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1}).status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1}).status_code == 200
        assert http.post("/v1/tokenize", json={"prompt": "Hello"}).status_code == 200
    assert len(threads) >= 3 and all(name.startswith("fxrewrite-tokenizer") for name in threads), threads


TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def _chat(server, **body):
    with server.http() as http:
        return http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1, **body})


def test_a_request_chat_template_needs_the_servers_trust(server):
    response = _chat(server, chat_template=TEMPLATE)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    response = _chat(server, chat_template_kwargs={"chat_template": TEMPLATE})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


@pytest.fixture
def trusting(server, monkeypatch):
    monkeypatch.setattr(server.app.state.serving_chat, "trust_request_chat_template", True)


def test_a_trusted_request_chat_template_renders_the_prompt(server, trusting):
    expected = server.engine.tokenizer.encode("<<hi>>", add_special_tokens=False)
    with server.http() as http:
        tokens = http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "chat_template": TEMPLATE}).json()["tokens"]
    assert tokens == expected
    for body in ({"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}):
        response = _chat(server, **body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(expected)
    assert _chat(server).json()["usage"]["prompt_tokens"] != len(expected)  # the server's own otherwise


@pytest.mark.parametrize("template, needle", [
    ("{% for %}", "not a valid Jinja template"),
    ("/nonexistent/t.jinja", "'/nonexistent/t.jinja' is not a Jinja template"),
    ("{{ raise_exception('boom') }}", "boom"),
])
def test_a_bad_request_chat_template_is_a_400_naming_it(server, trusting, template, needle):
    response = _chat(server, chat_template=template)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template" and needle in error["message"]
    assert _chat(server).status_code == 200  # still serving


def test_request_logging_cuts_and_decodes_only_the_logged_ids(server, caplog, monkeypatch):
    from fxrewrite.runtime.server.api_server import RequestLogger

    tok = server.engine.tokenizer
    ids = tok.encode("one two three four five six seven eight nine ten eleven twelve thirteen fourteen")
    assert len(ids) > 12
    decoded = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda token_ids, *a, **k: decoded.append(len(token_ids)) or
                        original(token_ids, *a, **k))
    with caplog.at_level("INFO", logger="fxrewrite.requests"):
        RequestLogger(5, tok).log("r-cut", ids, "params")
    assert f"prompt_token_ids: {ids[:5]}," in caplog.text and str(ids[:6]).rstrip("]") not in caplog.text
    assert decoded == [5]  # not the whole prompt, on the event loop


BLOCK_WORD = "blockblock"


def test_health_answers_while_bad_words_are_tokenized(server, monkeypatch):
    """A few thousand bad_words are tokenized in the tokenizer thread, not when the request is admitted on the
    event loop (5,000 words stalled /health for 1.7 s): the tokenizer blocks on BLOCK_WORD until /health has
    answered, so on the event loop /health would time out."""
    tok = server.engine.tokenizer
    original = tok.encode
    reached, release, threads = threading.Event(), threading.Event(), set()

    def encode(text, *args, **kwargs):
        if isinstance(text, str) and BLOCK_WORD in text:
            threads.add(threading.current_thread().name)
            reached.set()
            release.wait(10)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    words = [f"word{i}" for i in range(3000)] + [BLOCK_WORD]
    result = {}

    def post():
        with server.http() as http:
            result["response"] = http.post("/v1/completions", json={
                "prompt": "Hello", "max_tokens": 2, "bad_words": words})

    poster = threading.Thread(target=post)
    poster.start()
    try:
        assert reached.wait(20), "the bad words never reached the tokenizer"
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert "response" not in result  # answered while the completion was still being tokenized
    finally:
        release.set()
        poster.join(30)
    assert result["response"].status_code == 200, result["response"].text
    assert threads and all(name.startswith("fxrewrite-tokenizer") for name in threads), threads


def test_bad_words_of_the_wrong_type_are_a_400_naming_the_field(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "bad_words": ["ok", ""]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "bad_words" and "non-empty strings" in error["message"]
