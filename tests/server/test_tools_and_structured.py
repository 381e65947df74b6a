"""Structured outputs and tool calling through the real `openai` client against the test server (tiny
Qwen3 with Qwen3's real chat template, which renders tools and writes Hermes-style <tool_call> blocks;
`--enable-auto-tool-choice`, so the parser is picked by the template)."""

import json
import re

import openai
import pytest

import xgrammar  # noqa: E402,F401 - the serve extra (`make setup` installs it): missing is a setup fault
import jsonschema  # noqa: E402

# slow: runs first under xdist (tests/conftest.py); xgrammar's tokenizer info built before any request
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("grammar_compiler")]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{0,9}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast",
                                      "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]
COMPACT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
JSON_OBJECT_SEED, JSON_OBJECT_MAX_TOKENS = 1, 60


def _client(server):
    return server.client().with_options(timeout=600)  # a loaded 2-core CI machine is slow


def _chat(server, **kwargs):
    kwargs.setdefault("max_tokens", 100)
    return _client(server).chat.completions.create(model=server.model_name, messages=MESSAGES, **kwargs)


def test_json_schema_outputs_validate(server):
    # Free whitespace off: a random model would otherwise emit whitespace until max_tokens.
    out = _chat(server, n=6, temperature=1.0, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    out = _chat(server, n=3, temperature=1.0, extra_body=COMPACT)
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert "\n" not in choice.message.content and "  " not in choice.message.content


def test_json_object_regex_choice_and_grammar(server):
    client = _client(server)
    # A random model never closes a free JSON string by itself (any of 151k tokens may follow, greedy or seeded: it
    # runs to max_tokens); a bias on '"' and '}' closes every string and the object as soon as the grammar allows.
    tok = server.engine.tokenizer
    close = {str(i): 100 for text in ('"', "}") for i in tok.encode(text, add_special_tokens=False)}
    assert len(close) == 2
    out = _chat(server, max_tokens=JSON_OBJECT_MAX_TOKENS, temperature=1.0, seed=JSON_OBJECT_SEED, logit_bias=close,
                response_format={"type": "json_object"},
                extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert len(out.choices) == 1
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict), out.choices[0].message.content
    out = client.completions.create(model=server.model_name, prompt="Code:", max_tokens=20, n=4, temperature=1.0,
                                    extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert len(out.choices) == 4
    for c in out.choices:
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", c.text) and c.finish_reason == "stop", c.text
    out = _chat(server, n=4, temperature=1.0, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert len(out.choices) == 4 and {c.message.content for c in out.choices} <= {"sunny", "rainy"}
    out = _chat(server, temperature=1.0, extra_body={"guided_grammar": 'root ::= "a" [0-9] "z"'})
    assert len(out.choices) == 1 and re.fullmatch(r"a[0-9]z", out.choices[0].message.content), out.choices[0]
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, message", [
    ({"guided_json": {"type": "objec"}}, "invalid json"),
    ({"guided_regex": "(ab"}, "invalid regex"),
    ({"guided_grammar": "root ::= nothing"}, "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only one output constraint"),
    ({"structured_outputs": {"jsonn": {}}},
     r"structured_outputs: unknown key\(s\) \['jsonn'\]; expected one of json, "),
    ({"structured_outputs": {"json_object": False}}, r"structured_outputs: exactly one of json, regex"),
    ({"structured_outputs": {}},
     r"structured_outputs: no output constraint given; set one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "no output constraint given"),
])
def test_bad_constraints_are_400_before_queueing(server, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        _chat(server, extra_body=extra)
    server.wait_until(server.all_blocks_free)


def test_named_tool_choice_forces_a_valid_call(server):
    out = _chat(server, tools=TOOLS, temperature=1.0, tool_choice={"type": "function", "function": {"name": "get_forecast"}})
    message = out.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_forecast" and call.id.startswith("call") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_named_tool_choice_streams_argument_deltas(server):
    stream = _chat(server, tools=TOOLS, temperature=1.0, stream=True,
                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    names, args, ids, finish = [], "", set(), None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                ids.add(delta.id) if delta.id else None
                names += [delta.function.name] if delta.function.name else []
                args += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert names == ["get_time"] and len(ids) == 1 and json.loads(args)["tz"] in ("UTC", "CET")
    assert finish == "stop"


def test_required_tool_choice(server):
    # Sampled (seeded) from a random model: each choice must still end as a valid forced call.
    out = _chat(server, tools=TOOLS, temperature=1.0, n=2, seed=3, tool_choice="required", max_tokens=300)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_forecast", "get_time")
            json.loads(call.function.arguments)


# As pydantic writes a nested model: `#/$defs/...` points at the root of the parameters schema.
DEFS_TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
    "additionalProperties": False, "$defs": {"Place": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                                       "required": ["tz"], "additionalProperties": False}}}}}


def test_required_tool_choice_takes_parameters_with_defs(server):
    """tool_choice "required" wraps each tool's parameters in a list schema, so their `$defs` move to its root
    (as vLLM does), where the parameters' references find them; the tool in the request is left as it was."""
    tools = [DEFS_TOOL, TOOLS[1]]
    out = _chat(server, tools=tools, temperature=1.0, seed=3, tool_choice="required", max_tokens=200,
                parallel_tool_calls=False)  # one call: a random model may list calls until max_tokens
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls, out.choices[0]
    for call in calls:
        schema = next(t for t in tools if t["function"]["name"] == call.function.name)["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": {"type": "string"}}}}}
    with pytest.raises(openai.BadRequestError, match="Place") as e:
        _chat(server, tools=[DEFS_TOOL, clash], tool_choice="required")
    assert e.value.param == "tools"


FORCED_HERMES = r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_hermes_call(server, stream):
    """The model's own format, parsed (its text is forced by a regex here: a random model never writes it)."""
    out = _chat(server, tools=TOOLS, stream=stream, temperature=1.0, extra_body={"guided_regex": FORCED_HERMES})
    if not stream:
        choice = out.choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in calls]
    else:
        content, pieces, finish = "", {}, None
        for chunk in out:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    name, args = pieces.get(d.index, ("", ""))
                    pieces[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
                finish = choice.finish_reason or finish
        calls = list(pieces.values())
    assert content.strip() == "Sure."  # streamed content keeps the newline before <tool_call>
    assert len(calls) == 1 and calls[0][0] == "get_time" and json.loads(calls[0][1])["tz"] in ("UTC", "CET")
    assert finish == "tool_calls"


TWO_HERMES_CALLS = (r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}\n</tool_call>\n'
                    r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "CET"\}\}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_tool_choice_keeps_one_call_without_parallel_tool_calls(server, stream, parallel):
    """Two calls in the model's text: both returned, or only the first with parallel_tool_calls=false (vLLM)."""
    out = _chat(server, tools=TOOLS, stream=stream, temperature=1.0, parallel_tool_calls=parallel,
                extra_body={"guided_regex": TWO_HERMES_CALLS})
    if stream:
        zones = [json.loads(d.function.arguments)["tz"] for chunk in out for c in chunk.choices
                 for d in c.delta.tool_calls or []]
    else:
        zones = [json.loads(c.function.arguments)["tz"] for c in out.choices[0].message.tool_calls]
    assert zones == (["UTC", "CET"] if parallel else ["UTC"])


def test_tool_messages_and_null_content_replay(server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    out = _client(server).chat.completions.create(model=server.model_name, messages=messages, tools=TOOLS,
                                                  tool_choice="none", max_tokens=3)
    assert out.choices[0].message.tool_calls == [] and out.choices[0].finish_reason in ("length", "stop")
    with server.http() as http:
        ids = http.post("/v1/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = server.engine.tokenizer.decode(ids)
    assert '"arguments": {"tz": "UTC"}' in text and "<tool_response>\n12:00\n</tool_response>" in text


def test_tool_errors(server):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "absent"}})
    with pytest.raises(openai.BadRequestError, match="arguments are not valid JSON"):
        _client(server).chat.completions.create(model=server.model_name, max_tokens=2, messages=[
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}])
    with pytest.raises(openai.BadRequestError, match=r"cannot be combined .*\(response_format\)"):
        _chat(server, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match=r"cannot be combined .*\(structured_outputs\)"):
        _chat(server, tools=TOOLS, tool_choice="required", extra_body={"structured_outputs": {"regex": "a+"}})


def test_template_that_cannot_render_tools_is_a_400(server):
    from fastapi.testclient import TestClient

    from fxrewrite.runtime.server.api_server import build_app

    app = build_app(server.engine, served_model_names=[server.model_name],
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    response = TestClient(app).post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                                  "tool_choice": "required"})
    assert response.status_code == 400 and "cannot render tools" in response.json()["error"]["message"]
    response = TestClient(build_app(server.engine)).post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    assert response.status_code == 400 and "--enable-auto-tool-choice" in response.json()["error"]["message"]


def test_a_dead_grammar_process_fails_only_the_constrained_request(server, monkeypatch):
    """The grammar process killed while a constrained and a plain completion share the engine's steps: the
    constrained one is a 500 naming the cause, the plain one completes, the blocks are freed, and the next
    constrained request gets a fresh grammar process."""
    from concurrent.futures import ThreadPoolExecutor

    engine, step, killed = server.engine, server.engine.step, []

    def step_then_kill():
        outputs = step()
        if not killed and len(engine.requests) == 2 and engine._structured.constrained:
            engine._structured.process._proc.kill()
            killed.append(engine._structured.process._proc.wait())
        return outputs

    monkeypatch.setattr(engine, "step", step_then_kill)
    endless = {"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}}}
    body = dict(model=server.model_name, prompt="numbers:", max_tokens=40, temperature=0)
    with server.http() as http, ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(http.post, "/v1/completions", json={**body, **endless, "max_tokens": 400})
        server.wait_until(lambda: engine._structured is not None and engine._structured.constrained)
        plain = pool.submit(http.post, "/v1/completions", json={**body, "prompt": "hello", "ignore_eos": True})
        constrained, plain = constrained.result(), plain.result()
    assert killed and constrained.status_code == 500, constrained.text
    assert "structured outputs failed: the grammar process is gone" in constrained.json()["error"]["message"]
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 40
    server.wait_until(server.all_blocks_free)
    monkeypatch.undo()
    again = server.client().completions.create(model=server.model_name, prompt="numbers:", max_tokens=8,
                                               extra_body=endless)
    assert again.choices[0].text.startswith("[")


@pytest.mark.parametrize("name", ["", "bad name!", "x" * 65, "get.weather"])
def test_a_function_name_openai_refuses_is_a_400(server, name):
    """OpenAI's rule, ^[a-zA-Z0-9_-]{1,64}$ (was accepted, and tool_choice "required" then produced calls of that
    name; a fresh user's find)."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert f"function name {name!r} must be 1 to 64 letters, digits, '_' or '-'" in error["message"]
    assert error["param"].startswith("tools")
