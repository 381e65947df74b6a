"""Chat options and request checks a fresh-user run found missing, against the real test server (tiny
Qwen3, its real tokenizer and chat template): vLLM's continue_final_message, JSON booleans refused where
a number is expected, and no empty-content chunks while a multi-byte character is incomplete."""

import json

import pytest

PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
CHAT = {"messages": PREFILL[:1], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
LEAD_BYTE, CONTINUATION_BYTE = 127, 97  # Qwen's byte-level tokens for 0xC3 and 0xA4: "ä" in UTF-8


def _error(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def test_continue_final_message_continues_the_assistant_message(server):
    tok = server.engine.tokenizer
    with server.http() as http:
        r = http.post("/v1/tokenize", json={"messages": PREFILL, "add_generation_prompt": False,
                                            "continue_final_message": True})
        ids = r.json()["tokens"]
        assert tok.decode(ids).endswith("My answer is"), tok.decode(ids)
        assert ids == tok.encode(tok.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True),
                                 add_special_tokens=False)
        r = http.post("/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 3, "temperature": 0,
                                                    "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_echo_puts_the_continued_message_before_the_reply(server):
    """vLLM's chat `echo`: with the last message the assistant's, each choice starts with its text, streamed as one
    chunk after the role (was ignored with a log line; a fresh user found it). A user's last message is not echoed."""
    body = {"messages": PREFILL, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "n": 2}
    with server.http() as http:
        plain = http.post("/v1/chat/completions", json=body).json()["choices"]
        echoed = http.post("/v1/chat/completions", json=body | {"echo": True}).json()["choices"]
        assert [c["message"]["content"] for c in echoed] == [
            "My answer is" + (c["message"]["content"] or "") for c in plain]
        with http.stream("POST", "/v1/chat/completions", json=body | {"echo": True, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = {0: "", 1: ""}
        for event in events:
            for c in event["choices"]:
                text[c["index"]] += c["delta"].get("content") or ""
        assert [text[0], text[1]] == [c["message"]["content"] for c in echoed]
        assert [c["delta"] for e in events[2:4] for c in e["choices"]] == [{"content": "My answer is"}] * 2
        user_last = http.post("/v1/chat/completions", json=CHAT | {"echo": True, "temperature": 0}).json()
        reply = http.post("/v1/chat/completions", json=CHAT | {"temperature": 0}).json()
        assert user_last["choices"][0]["message"] == reply["choices"][0]["message"]


def test_continue_final_message_with_a_generation_prompt_is_400(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": PREFILL, "continue_final_message": True,
                                                    "max_tokens": 2})
    assert "cannot both be true" in _error(r, 400, "continue_final_message")


def test_a_continued_user_message_is_answered_in_its_role(server):
    """As in transformers and vLLM, any last message may be continued: the prompt ends inside the user's turn and
    the reply has the user's role (vLLM's get_chat_request_role), echoed with `echo` (the role matches)."""
    user_last = PREFILL[:1]
    tok = server.engine.tokenizer
    body = {"messages": user_last, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    with server.http() as http:
        ids = http.post("/v1/tokenize", json=body).json()["tokens"]
        assert tok.decode(ids).endswith(user_last[0]["content"]), tok.decode(ids)
        reply = http.post("/v1/chat/completions", json=body).json()
        echoed = http.post("/v1/chat/completions", json=body | {"echo": True}).json()
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
    message = reply["choices"][0]["message"]
    assert message["role"] == "user" and reply["usage"]["prompt_tokens"] == len(ids)
    assert echoed["choices"][0]["message"]["content"] == user_last[0]["content"] + (message["content"] or "")
    assert first["choices"][0]["delta"] == {"role": "user", "content": ""}


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", CHAT | {"max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": True}, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"n": True}, "n"),
    ("/v1/chat/completions", CHAT | {"top_k": False}, "top_k"),
    ("/v1/chat/completions", CHAT | {"seed": True}, "seed"),
    ("/v1/chat/completions", CHAT | {"min_tokens": True}, "min_tokens"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"temperature": True}, "temperature"),
    ("/v1/chat/completions", CHAT | {"stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", COMPLETION | {"logprobs": True}, "logprobs"),
    ("/v1/completions", COMPLETION | {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", COMPLETION | {"prompt": [True, False]}, "prompt"),
    ("/v1/detokenize", {"tokens": [True]}, "tokens"),
])
def test_booleans_are_not_integers(server, path, body, field):
    with server.http() as http:
        r = http.post(path, json=body)
    message = _error(r, 400, field)
    assert message.startswith(field) and ("true" in message or "false" in message or '"5"' in message), message


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", COMPLETION | {"stream": "yes"}, "stream"),
    ("/v1/completions", COMPLETION | {"stream": 1}, "stream"),
    ("/v1/completions", COMPLETION | {"echo": "true"}, "echo"),
    ("/v1/completions", COMPLETION | {"ignore_eos": 0}, "ignore_eos"),
    ("/v1/chat/completions", CHAT | {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", CHAT | {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", CHAT | {"add_generation_prompt": "false"}, "add_generation_prompt"),
    ("/v1/tokenize", {"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens"),
])
def test_non_booleans_are_refused_where_a_boolean_is_expected(server, path, body, field):
    """OpenAI answers a 400 for "stream": "yes" or 1; pydantic's lax mode would take them as true."""
    with server.http() as http:
        r = http.post(path, json=body)
    message = _error(r, 400, field.split(".")[0])  # param: the top-level field
    assert message.startswith(field) and "expected true or false" in message, message


def test_integral_values_still_work(server):
    with server.http() as http:
        r = http.post("/v1/completions", json=COMPLETION | {"temperature": 0, "top_p": 1, "seed": 3})
    assert r.status_code == 200, r.text


def _events(response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_sends_no_empty_chunks_while_a_character_is_incomplete(server):
    """Only 0xC3 (the lead byte of "ä") and 0xA4 (its continuation) can be sampled (logit_bias), so the text
    is held while a character is incomplete: no chunk then, and the held tokens' logprobs come with the
    text they complete. OpenAI's stream: the role chunk, chunks with text, the finish_reason chunk."""
    bias = {"logit_bias": {str(LEAD_BYTE): 100, str(CONTINUATION_BYTE): 100}, "max_tokens": 12, "temperature": 1.0,
            "seed": 7}  # sampled: both bytes occur
    with server.http() as http:
        whole = http.post("/v1/completions", json=COMPLETION | bias | {"logprobs": 0}).json()["choices"][0]
        tokens = whole["logprobs"]["tokens"]
        assert "ä" in whole["text"] and len(tokens) == 12
        with http.stream("POST", "/v1/completions", json=COMPLETION | bias | {"stream": True}) as r:
            chunks = [c["choices"][0] for c in _events(r)]
        assert all(c["text"] for c in chunks[:-1]) and chunks[-1]["finish_reason"] == "length", chunks
        assert "".join(c["text"] for c in chunks) == whole["text"] and len(chunks) < len(tokens)
        with http.stream("POST", "/v1/chat/completions", json=CHAT | bias | {"logprobs": True, "stream": True}) as r:
            chunks = [c["choices"][0] for c in _events(r)]
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[0]["delta"]["content"] == ""
    assert all(c["delta"].get("content") for c in chunks[1:-1]) and chunks[-1]["finish_reason"] == "length"
    assert sum(len(c["logprobs"]["content"]) for c in chunks[1:]) == 12


def test_chat_template_kwargs_override_the_named_options_as_in_vllm(server):
    """vLLM merges chat_template_kwargs over add_generation_prompt / continue_final_message / tools."""
    tok = server.engine.tokenizer
    with server.http() as http:
        r = http.post("/v1/tokenize", json={"messages": PREFILL[:1],
                                            "chat_template_kwargs": {"add_generation_prompt": False}})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(PREFILL[:1], tokenize=False),
                                                add_special_tokens=False)
        r = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("kwargs, needle", [
    ({"tokenize": True}, "may not set ['tokenize']"),
    ({"conversation": [], "messages": []}, "may not set ['conversation', 'messages']"),
    ({"add_generation_prompt": "yes"}, "must be true or false"),
])
def test_chat_template_kwargs_that_clash_with_the_renderer_are_400(server, kwargs, needle):
    with server.http() as http:
        for path in ("/v1/chat/completions", "/v1/tokenize"):
            body = {**CHAT, "chat_template_kwargs": kwargs}
            if path == "/v1/tokenize":
                body.pop("max_tokens")
            assert needle in _error(http.post(path, json=body), 400, "chat_template_kwargs")


def test_documents_reach_the_chat_template_as_in_vllm(server, monkeypatch, caplog):
    """fresh-user report: vLLM's `documents` field (RAG templates read it) was logged as ignored and the prompt
    rendered without the documents."""
    template = ("{% for d in documents or [] %}<{{ d['title'] }}:{{ d['text'] }}>{% endfor %}"
                "{{ messages[0]['content'] }}")
    monkeypatch.setattr(server.app.state.serving_chat, "chat_template", template)
    tok, docs = server.engine.tokenizer, [{"title": "Paris", "text": "is the capital of France"}]
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.server.protocol"), server.http() as http:
        usage = [http.post("/v1/chat/completions", json={**CHAT, **extra}).json()["usage"]["prompt_tokens"]
                 for extra in ({"documents": docs}, {})]
        bad = http.post("/v1/chat/completions", json={**CHAT, "documents": [{"title": 5}]})
    assert usage == [len(tok.encode("<Paris:is the capital of France>Name a colour.", add_special_tokens=False)),
                     len(tok.encode("Name a colour.", add_special_tokens=False))]
    assert "ignored" not in caplog.text
    assert "documents: expected a list of objects of strings" in _error(bad, 400, "documents")


def test_response_ids_take_the_clients_request_id_as_in_vllm(server, caplog):
    """fresh-user report: vLLM names a response `chatcmpl-<X-Request-Id>` (else the body's `request_id`), so logs and
    clients can follow one id; here the id was always new and `request_id` logged as ignored. Two requests may send
    the same id: the engine's ids stay unique."""
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.server.protocol"), server.http() as http:
        header = http.post("/v1/chat/completions", json={**CHAT, "request_id": "body-2"},
                           headers={"X-Request-Id": "trace-1"}).json()["id"]
        body = http.post("/v1/chat/completions", json={**CHAT, "request_id": "body-2"}).json()["id"]
        completion = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-1"}).json()["id"]
        fresh = http.post("/v1/chat/completions", json=CHAT).json()["id"]
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50},
                         headers={"X-Request-Id": "same"}) as open_stream:
            next(open_stream.iter_lines())  # the first request is in the engine while the second runs
            second = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "same"})
            assert second.status_code == 200 and second.json()["id"] == "chatcmpl-same"
    assert (header, body, completion) == ("chatcmpl-trace-1", "chatcmpl-body-2", "cmpl-trace-1")
    assert fresh.startswith("chatcmpl-") and len(fresh) == len("chatcmpl-") + 32
    assert "ignored" not in caplog.text
    server.wait_until(server.all_blocks_free)
