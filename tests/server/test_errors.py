"""Every error case answers with its status and OpenAI's body {"error": {message, type, param, code}}."""

import json

import openai
import pytest


# "model" left out: the server then uses its (only) served name.
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", COMPLETION | {"temperature": -1}, "temperature"),
        ("/v1/completions", COMPLETION | {"n": 0}, "n"),
        ("/v1/completions", COMPLETION | {"top_p": 0}, "top_p"),
        ("/v1/completions", COMPLETION | {"max_tokens": -1}, "max_tokens"),
        ("/v1/completions", COMPLETION | {"logprobs": 99}, "logprobs"),
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/completions", COMPLETION | {"prompt": [10**9]}, "prompt"),
        ("/v1/chat/completions", CHAT | {"messages": []}, "messages"),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": True}}, "stream_options"),
        # request-level checks name the field too, not param null
        ("/v1/completions", COMPLETION | {"prompt": ""}, "prompt"),
        ("/v1/completions", COMPLETION | {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", COMPLETION | {"min_tokens": 5}, "min_tokens"),
        ("/v1/completions", COMPLETION | {"best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", COMPLETION | {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", CHAT | {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", COMPLETION | {"logit_bias": {"abc": 5}}, "logit_bias"),
        # str.isdigit() takes these, then int() failed with param null
        ("/v1/completions", COMPLETION | {"logit_bias": {"¹": 1}}, "logit_bias"),
        ("/v1/chat/completions", CHAT | {"logit_bias": {"①": 1}}, "logit_bias"),
        ("/v1/completions", COMPLETION | {"logit_bias": {"--5": 1}}, "logit_bias"),
        # float32 makes 1e308 inf, and logits / inf NaN: token 0 was sampled, against a grammar too (which then
        # failed every request in flight)
        ("/v1/completions", COMPLETION | {"temperature": 1e308}, "temperature"),
        ("/v1/completions", COMPLETION | {"temperature": 1e308, "guided_choice": ["a", "b"]}, "temperature"),
        ("/v1/chat/completions", CHAT | {"temperature": 1e308, "response_format": {"type": "json_object"}},
         "temperature"),
        ("/v1/chat/completions", CHAT | {"repetition_penalty": 1e-39}, "repetition_penalty"),
        # a past tool call's arguments nested too deeply for json.loads (RecursionError: a 500)
        ("/v1/chat/completions", CHAT | {"messages": [
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]},
            {"role": "user", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}],
                                        "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        # a constraint that does not compile names the field that set it
        ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
        ("/v1/completions", COMPLETION | {"guided_regex": "(["}, "guided_regex"),
        ("/v1/chat/completions", CHAT | {"presence_penalty": "lots"}, "presence_penalty"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user"}]}, "messages"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": []}]}, "messages"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        # a lone UTF-16 surrogate passes JSON and pydantic, but no tokenizer can encode it
        ("/v1/completions", COMPLETION | {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages"),
        ("/v1/tokenize", {"prompt": "\udfff"}, "prompt"),
        # the chat endpoint's checks, through /v1/tokenize too (were 500s)
        ("/v1/tokenize", {"messages": []}, "messages"),
        ("/v1/tokenize", {"messages": CHAT["messages"], "tools": [{}]}, "tools"),
        ("/v1/tokenize", {"messages": CHAT["messages"], "tools": [{"type": "function", "function": {"name": 5}}]},
         "tools"),
        ("/v1/completions", COMPLETION | {"stop_token_ids": [99999999]}, "stop_token_ids"),
        # fresh-user reports: named logprobs (chat has no such number), param null, "yes" taken as true
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        # vLLM's -1 (the whole vocabulary) is taken, and refused by the default max_logprobs (20); -2 is no count
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/completions", COMPLETION | {"logprobs": -1}, "logprobs"),
        ("/v1/completions", COMPLETION | {"logprobs": -2}, "logprobs"),
        ("/v1/chat/completions", CHAT | {"bad_words": [""]}, "bad_words"),
        ("/v1/completions", COMPLETION | {"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 1},
         "allowed_token_ids"),
        ("/v1/chat/completions", CHAT | {"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
         "structured_outputs"),
    ],
)
def test_bad_parameters_are_400(server, path, body, param):
    with server.http() as http:  # json.dumps escapes non-ASCII (httpx's json= would not encode a lone surrogate)
        error = _error(http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == "invalid_value"
    if param:
        assert param in error["message"]


def test_null_optional_fields_take_their_defaults(server):
    with server.http() as http:
        done = http.post("/v1/completions", json=COMPLETION | {"n": None, "stream": None, "echo": None})
        assert done.status_code == 200 and len(done.json()["choices"]) == 1, done.text
        chat = http.post("/v1/chat/completions", json=CHAT | {"logprobs": None, "n": None})
        assert chat.status_code == 200 and chat.json()["choices"][0]["logprobs"] is None, chat.text
        error = _error(http.post("/v1/chat/completions", json=CHAT | {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]}), 400)
    assert error["message"] == "messages[0].content[1].text must be a string, got None"


def test_type_error_names_the_field_what_it_expects_and_what_it_got(server):
    with server.http() as http:
        error = _error(http.post("/v1/chat/completions", json=CHAT | {"stop": 5}), 400)
    assert error["param"] == "stop" and error["code"] == "invalid_value"
    assert error["message"] == "stop: expected a string or a list of strings, got 5 (a number)"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_json_is_400(server, path, raw):
    with server.http() as http:
        error = _error(http.post(path, content=raw, headers={"Content-Type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error"
    if raw != b"{not json":
        assert "JSON object" in error["message"]


def test_a_body_that_is_not_utf8_is_400_json_invalid(server):
    with server.http() as http:
        error = _error(http.post("/v1/completions", content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                                 headers={"Content-Type": "application/json"}), 400)
    assert error["code"] == "json_invalid" and error["message"].startswith("request body is not valid JSON")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_nested_too_deeply_is_400_saying_so(server, path):
    """Valid UTF-8 JSON that json.loads cannot parse (RecursionError) was blamed on its encoding."""
    body = b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with server.http() as http:
        error = _error(http.post(path, content=body, headers={"Content-Type": "application/json"}), 400)
    assert error["code"] == "json_invalid" and error["message"].startswith("request body is nested too deeply")


def test_form_encoded_body_is_400_asking_for_json(server):
    with server.http() as http:
        error = _error(http.post("/v1/completions", content=b"prompt=hi",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"}), 400)
        assert error["message"] == ("request body must be sent with Content-Type: application/json "
                                    "(got Content-Type 'application/x-www-form-urlencoded')")
        bare = _error(http.post("/v1/completions", content=json.dumps(COMPLETION)), 400)  # JSON text, no header
        assert bare["message"].endswith("(got no Content-Type)") and bare["code"] == "invalid_body"
        listed = _error(http.post("/v1/completions", json=[1, 2]), 400)  # the header is right: the body is not
        assert listed["message"] == "request body must be a JSON object"


def test_prompt_over_max_model_len_is_400_naming_both_lengths(server):
    too_long = [100] * (server.max_model_len + 10)
    with server.http() as http:
        error = _error(http.post("/v1/completions", json=COMPLETION | {"prompt": too_long}), 400)
        assert str(server.max_model_len) in error["message"] and str(server.max_model_len + 10) in error["message"]
        assert error["code"] == "context_length_exceeded"
        fits = [100] * (server.max_model_len - 10)
        error = _error(http.post("/v1/completions", json=COMPLETION | {"prompt": fits, "max_tokens": 50}), 400)
        assert str(server.max_model_len) in error["message"] and "50" in error["message"]
        # F11: the offline API caps max_tokens at max_model_len; the server refuses an explicit one, as vLLM's does
        error = _error(http.post("/v1/completions", json=COMPLETION | {"max_tokens": 10**9}), 400)
        assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
        chat = CHAT | {"messages": [{"role": "user", "content": "word " * (server.max_model_len + 5)}]}
        error = _error(http.post("/v1/chat/completions", json=chat), 400)
        assert str(server.max_model_len) in error["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=server.model_name, prompt=too_long, max_tokens=2)


def test_default_max_tokens_is_clamped_to_the_context(server):
    fits = [100] * (server.max_model_len - 3)
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": server.model_name, "prompt": fits, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == server.max_model_len - 3
    assert body["usage"]["completion_tokens"] == 3  # ignore_eos: the whole rest of the context
    assert len(body["choices"]) == 1 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "token-abc123"}])
def test_missing_or_wrong_api_key_is_401(server, headers):
    import httpx

    r = httpx.post(f"{server.base_url}/v1/completions", json=COMPLETION, headers=headers, timeout=10)
    error = _error(r, 401)
    assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_model_is_404(server):
    with server.http() as http:
        error = _error(http.post("/v1/chat/completions", json=CHAT | {"model": "gpt-17"}), 404)
    assert "gpt-17" in error["message"] and error["param"] == "model"
    assert error["type"] == "not_found_error" and error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-17", prompt="hi", max_tokens=1)


def test_unknown_route_is_404_in_openai_shape(server):
    with server.http() as http:
        error = _error(http.get("/v1/nothing-here"), 404)
    assert error["type"] == "not_found_error" and error["param"] is None
    assert error["code"] is None  # starlette's 404: the server sets no code (errors._on_http_error)


def test_cors_preflight_is_answered_before_the_api_key(server):
    """vLLM's default CORS (--allowed-origins ["*"]): a browser's OPTIONS preflight gets the CORS headers (not a
    405 or 401), and a keyed request's response carries Access-Control-Allow-Origin."""
    import httpx

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{server.base_url}/v1/chat/completions", headers=preflight, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    with server.http() as http:
        r = http.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("value", ["*", '{"a": 1}', "[1]", "not json"])
def test_bad_allowed_origins_names_the_flag(value, capsys):
    from fxrewrite.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", value])
    err = capsys.readouterr().err
    assert "--allowed-origins" in err and "JSON list of strings" in err
