"""POST /v1/responses (OpenAI's Responses API) through the real `openai` client against the test server (tiny
Qwen3 with Qwen3's chat template; `--enable-auto-tool-choice`). It is served on the chat path, so a greedy answer
is chat's; streamed events parse as the client's types; errors are chat's 400s, named in this API's fields. The
random model's text is forced with vLLM's `structured_outputs` where a test needs chosen text, as the chat tests do."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import ServerHandle, cli_server

import xgrammar  # noqa: F401 - the serve extra (`make setup` installs it): missing is a setup fault

# slow: runs first under xdist (tests/conftest.py); xgrammar's tokenizer info built before any request
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("grammar_compiler")]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0.0, "max_output_tokens": 8, "extra_body": {"ignore_eos": True}}
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}
HERMES_CALL = r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}\n</tool_call>'


def _client(server):
    return server.client().with_options(timeout=600)  # a loaded 2-core CI machine is slow


def _create(server, **kwargs):
    return _client(server).responses.create(model=server.model_name, **kwargs)


def _chat_text(server, messages, max_tokens=8):
    out = _client(server).chat.completions.create(model=server.model_name, messages=messages, temperature=0.0,
                                                  max_tokens=max_tokens, extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def _forced(regex):
    return {"structured_outputs": {"regex": regex}}


def test_text_answer_is_the_chat_answer_with_instructions_as_the_system_message(server):
    response = _create(server, instructions="Be brief.", input=[{"role": "user", "content": "Say hello."}], **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == server.model_name
    assert response.output_text == _chat_text(server, MESSAGES)
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    # cut by max_output_tokens
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.temperature, response.max_output_tokens, response.tool_choice) == (0.0, 8, "auto")
    assert response.text.format.type == "text" and response.tools == [] and response.parallel_tool_calls
    assert response.instructions == "Be brief."
    # a string input is one user message, and so is a message of input_text parts
    parts = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]
    for given in ("Say hello.", parts):
        assert _create(server, input=given, **GREEDY).output_text == _chat_text(server, MESSAGES[1:])
    server.wait_until(server.all_blocks_free)


def test_a_finished_answer_is_completed(server):
    response = _create(server, input="Greet.", max_output_tokens=20, extra_body=_forced(r"Hi there\."),
                       metadata={"k": "v"}, user="u1")
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == "Hi there." and response.output[0].status == "completed"
    assert response.metadata == {"k": "v"} and response.user == "u1"


def test_developer_and_system_messages_join_the_instructions(server):
    """As vLLM's Responses API: with a chat template that has no developer role (Qwen3's drops it silently), a
    developer message is a system one, and every system text joins one leading system message."""
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    assert _create(server, input=developer, **GREEDY).output_text == _chat_text(server, MESSAGES)
    mixed = [{"role": "user", "content": "Say hello."}, {"role": "system", "content": "B"},
             {"role": "developer", "content": [{"type": "input_text", "text": "C"}]}]
    joined = [{"role": "system", "content": "A\n\nB\n\nC"}, MESSAGES[1]]
    response = _create(server, instructions="A", input=mixed, **GREEDY)
    assert response.output_text == _chat_text(server, joined) and response.instructions == "A"


def test_stream_events_parse_and_join_to_the_answer(server):
    kwargs = {"input": "Count to ten.", "temperature": 0.0, "max_output_tokens": 12}
    whole = _create(server, **kwargs)
    events = list(_create(server, stream=True, **kwargs))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    assert {e.type for e in events[4:-4]} == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert type(events[0]).__name__ == "ResponseCreatedEvent" and events[0].response.status == "in_progress"
    assert type(events[4]).__name__ == "ResponseTextDeltaEvent"
    deltas = [e.delta for e in events[4:-4]]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.output[0].id == events[2].item.id == events[-4].item_id  # one item id throughout
    assert final.created_at == events[0].response.created_at
    server.wait_until(server.all_blocks_free)


def test_include_output_text_logprobs_gives_chats_logprobs_streamed_or_not(server):
    """include ["message.output_text.logprobs"] (+ top_logprobs): the output_text's per-token logprobs, chat's;
    streamed, the output_text.delta events carry them and join to the same list. Without the include, none."""
    kwargs = {"input": "Say hello.", "temperature": 0.0, "max_output_tokens": 6, "top_logprobs": 2,
              "include": ["message.output_text.logprobs"], "extra_body": {"ignore_eos": True}}
    response = _create(server, **kwargs)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 6 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert response.top_logprobs == 2  # echoed, as vLLM's response does
    chat = _client(server).chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "Say hello."}], temperature=0.0, max_tokens=6,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert [lp.token for lp in logprobs] == [lp.token for lp in chat]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in chat], abs=1e-4)
    events = list(_create(server, stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert [lp.token for lp in streamed] == [lp.token for lp in final] == [lp.token for lp in logprobs]
    alone = _create(server, input="x", max_output_tokens=2, top_logprobs=2)
    assert alone.output[0].content[0].logprobs is None and alone.top_logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs") as e:
        _create(server, input="x", max_output_tokens=2, top_logprobs=99, include=["message.output_text.logprobs"])
    assert e.value.param == "top_logprobs"


def test_logprobs_of_tokens_that_made_no_text_still_stream():
    """The tokens after the message's last text (a character's bytes cut by max_output_tokens: no text) send their
    logprobs on an empty output_text.delta, as chat's stream sends them, so the deltas join to the item's list."""
    from fxrewrite.runtime.server.protocol_responses import DeltaMessage
    from fxrewrite.runtime.server.responses_stream import ResponseEventWriter

    writer = ResponseEventWriter(logprobs=True)
    writer.pending = [{"token": "a", "logprob": -1.0}]
    events = writer.delta(DeltaMessage(content="a"))
    writer.pending = [{"token": "\\xf0", "logprob": -2.0}]
    events += writer.close("incomplete")
    bodies = [json.loads(e.split("data: ", 1)[1]) for e in events]
    deltas = [b for b in bodies if b["type"] == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [("a", ["a"]), ("", ["\\xf0"])]
    done = next(b for b in bodies if b["type"] == "response.output_text.done")
    assert [lp["token"] for lp in done["logprobs"]] == ["a", "\\xf0"] == [
        lp["token"] for lp in writer.items[0].content[0].logprobs]


def test_json_schema_and_json_object_text_formats(server):
    schema = TIME_TOOL["parameters"]
    compact = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model would emit whitespace
    response = _create(server, input="Which zone?", temperature=1.0, max_output_tokens=40, extra_body=compact,
                       text={"format": {"type": "json_schema", "name": "zone", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    assert response.text.format.schema_ == schema
    close = {str(i): 100 for text in ('"', "}") for i in server.engine.tokenizer.encode(text, add_special_tokens=False)}
    response = _create(server, input="JSON please.", temperature=1.0, max_output_tokens=60, text={"format": {
        "type": "json_object"}}, extra_body={**compact, "seed": 1, "logit_bias": close})
    assert isinstance(json.loads(response.output_text), dict), response.output_text


def test_tools_give_function_call_items(server):
    named = {"type": "function", "name": "get_time"}
    response = _create(server, input="What time is it?", tools=[TIME_TOOL], tool_choice=named, temperature=1.0,
                       max_output_tokens=40)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_time" and call.id.startswith("fc_") and call.call_id
    assert json.loads(call.arguments)["tz"] in ("UTC", "CET") and response.tool_choice.name == "get_time"
    assert response.tools[0].name == "get_time" and response.tools[0].parameters == TIME_TOOL["parameters"]
    # "auto": the model's own (Hermes) format, parsed; text before the call is the message
    response = _create(server, input="What time is it?", tools=[TIME_TOOL], max_output_tokens=60,
                       extra_body=_forced(HERMES_CALL))
    message, call = response.output
    assert message.type == "message" and response.output_text.strip() == "Sure."
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_time", {"tz": "UTC"})
    events = list(_create(server, input="What time is it?", tools=[TIME_TOOL], max_output_tokens=60, stream=True,
                          extra_body=_forced(HERMES_CALL)))
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"tz": "UTC"}
    items = events[-1].response.output
    assert [i.type for i in items] == ["message", "function_call"] and items[1].id == done.item_id
    server.wait_until(server.all_blocks_free)


@pytest.fixture(scope="module")
def plain_server(tiny_model_dir):
    """A server started without --enable-auto-tool-choice / --tool-call-parser (no tool parser at all)."""
    with cli_server(tiny_model_dir("qwen3")) as (url, engine, app, _):  # cli_server's default: 256 positions
        yield ServerHandle(url, engine, app, max_model_len=256)


def test_without_tools_the_output_is_text_with_or_without_a_tool_parser(server, plain_server):
    """A request without tools (tool_choice "auto", the Responses default) is plain text, as vLLM parses calls only
    for a request with tools: no 500 on a server without a tool parser (it was one for every /v1/responses and for
    chat's explicit tool_choice "auto"), and on one with a parser, call-shaped text is the message, streamed or not
    (unstreamed, it was parsed into a function_call item)."""
    response = _create(plain_server, input="Hi.", max_output_tokens=2)
    assert response.output[0].type == "message" and response.tool_choice == "auto"
    chat = _client(plain_server).chat.completions.create(model=plain_server.model_name, max_tokens=2,
                                                         messages=[{"role": "user", "content": "Hi."}],
                                                         tool_choice="auto")
    assert chat.choices[0].message.content and not chat.choices[0].message.tool_calls
    kwargs = {"input": "What time is it?", "max_output_tokens": 60, "extra_body": _forced(HERMES_CALL)}
    whole = _create(server, **kwargs)
    events = list(_create(server, stream=True, **kwargs))
    for output in (whole.output, events[-1].response.output):
        assert [i.type for i in output] == ["message"] and output[0].content[0].text.startswith("Sure.\n<tool_call>")
    chat = _client(server).chat.completions.create(model=server.model_name, max_tokens=60, tool_choice="auto",
                                                   messages=[{"role": "user", "content": "Hi."}],
                                                   extra_body=_forced(HERMES_CALL))
    assert "<tool_call>" in chat.choices[0].message.content and not chat.choices[0].message.tool_calls
    server.wait_until(server.all_blocks_free)
    plain_server.wait_until(plain_server.all_blocks_free)


def test_a_length_cut_marks_the_item_it_cut_incomplete_streamed_or_not(server):
    """max_output_tokens cutting the output: the item it cut is "incomplete" (a forced call's unfinished arguments
    too), one finished before it "completed", and the streamed response.completed says what the JSON one says."""
    def statuses(**kwargs):
        whole = _create(server, input="What time is it?", tools=[TIME_TOOL], **kwargs)
        events = list(_create(server, input="What time is it?", tools=[TIME_TOOL], stream=True, **kwargs))
        assert whole.status == events[-1].response.status == "incomplete"
        return [(i.type, i.status) for i in whole.output], [(i.type, i.status) for i in events[-1].response.output]

    # "auto": the message before a parsed call was finished; the length cut the text after the call
    whole, streamed = statuses(max_output_tokens=100, extra_body={**_forced(HERMES_CALL + r"\n[a-z]{1000}"),
                                                                  "ignore_eos": True})
    assert whole[:2] == streamed[:2] == [("message", "completed"), ("function_call", "completed")]
    # a named function's arguments cut short
    named = {"type": "function", "name": "get_time"}
    whole, streamed = statuses(tool_choice=named, max_output_tokens=3, temperature=1.0)
    assert whole == streamed == [("function_call", "incomplete")]
    # "required": a cut list has no calls; streamed, the calls already sent are incomplete
    whole, streamed = statuses(tool_choice="required", max_output_tokens=12, temperature=1.0)
    assert whole == [("message", "incomplete")] and streamed[-1] == ("message", "incomplete")
    assert set(streamed[:-1]) <= {("function_call", "incomplete")}
    server.wait_until(server.all_blocks_free)


def test_function_call_round_trip_is_the_chat_conversation(server):
    """function_call + function_call_output items are the assistant's tool call and the tool's message."""
    items = [{"role": "user", "content": "What time is it?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"tz": "UTC"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    response = _create(server, input=items, tools=[TIME_TOOL], tool_choice="none", **GREEDY)
    messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    chat = _client(server).chat.completions.create(
        model=server.model_name, messages=messages, tools=[{"type": "function", "function": {
            k: v for k, v in TIME_TOOL.items() if k != "type"}}], tool_choice="none", temperature=0.0, max_tokens=8,
        extra_body={"ignore_eos": True})
    assert response.output_text == chat.choices[0].message.content


def test_a_responses_output_items_go_back_as_input(server):
    """The next turn's input is the history plus the last response's output items (message, function_call,
    reasoning), as the openai client sends them: each becomes the assistant turn it was."""
    first = _create(server, input="Hi.", max_output_tokens=20, extra_body=_forced(r"Hello\."))
    history = [{"role": "user", "content": "Hi."}, *[item.model_dump() for item in first.output],
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
                   {"type": "reasoning_text", "text": "They ask."}]},
               {"role": "user", "content": "And?"}]
    second = _create(server, input=history, **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens and second.output_text
    with pytest.raises(openai.BadRequestError, match=r"input\[0\].content: expected a list of reasoning_text"):
        _create(server, input=[{"type": "reasoning", "content": "flat"}])


def test_reasoning_parser_gives_a_reasoning_item(server, monkeypatch):
    from fxrewrite.runtime.server.reasoning import REASONING_PARSERS

    monkeypatch.setattr(server.app.state.serving_chat, "reasoning_parser", REASONING_PARSERS["qwen3"])
    forced = _forced(r"<think>Let me see\.</think>\n\nParis\.")
    response = _create(server, input="Capital of France?", max_output_tokens=60, extra_body=forced,
                       reasoning={"effort": "low"})
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me see."
    assert message.type == "message" and response.output_text.strip() == "Paris."
    assert response.usage.output_tokens_details.reasoning_tokens > 0 and response.reasoning.effort == "low"
    events = list(_create(server, input="Capital of France?", max_output_tokens=60, extra_body=forced, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me see."
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.output_text == response.output_text


@pytest.mark.parametrize("body, param, message", [
    ({"temperature": -1}, "temperature", "temperature: expected a value greater than or equal to 0"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "Please reduce the length of the prompt or max_output_tokens"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", r"input\[0\].role: 'robot' is not one of"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", r"input\[0\].call_id: expected a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "only text content parts"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": [{"type": "reasoning", "content": 5}]}, "input", r"input\[0\].content: expected a list of reasoning"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input",
     "400 - input: tool call 'f': arguments are not valid JSON"),
    ({"tools": [{"type": "web_search"}]}, "tools", "expected 'function'"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice requires tools"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "objec"}}}}, "text", "text.format: invalid json"),
    ({"background": True}, "background", "does not support the background mode"),
    ({"top_k": "a"}, "top_k", "top_k: expected an integer"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates are not supported"),  # was ignored: another prompt
    # a misspelt include (OpenAI's and vLLM's list of values) gave no logprobs, silently
    ({"include": ["message.output_text.logprob"]}, "include",
     r"include\[0\]: expected 'file_search_call.results', .* or 'message.output_text.logprobs', got \"message.output_"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        _client(server).post("/responses", cast_to=httpx.Response,
                             body={"model": server.model_name, "input": "x", **body})
    assert e.value.param == param


def test_previous_response_id_is_refused_as_nothing_is_stored(server):
    with pytest.raises(openai.NotFoundError, match="does not store responses") as e:
        _create(server, input="And then?", previous_response_id="resp_123")
    assert e.value.param == "previous_response_id"
    for call in (_client(server).responses.retrieve, _client(server).responses.cancel):  # vLLM's routes, its 404
        with pytest.raises(openai.NotFoundError, match="Response with id 'resp_123' not found: this server does not"):
            call("resp_123")
    with server.http() as http:  # the key guards the route as every /v1 route
        assert httpx.post(f"{server.base_url}/v1/responses", json={"input": "x"}).status_code == 401
        assert http.post("/v1/responses", json={"input": "x", "model": "other"}).status_code == 404
        # store is accepted (and ignored, as vLLM does without its store)
        assert http.post("/v1/responses", json={"input": "x", "store": True, "max_output_tokens": 1}).status_code == 200


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": server.model_name, "input": "A long story:", "max_output_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with server.http() as http:
        with http.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            kinds = [line for line in (next(lines) for _ in range(20)) if line.startswith("event: ")]
            assert "event: response.output_text.delta" in kinds
    server.wait_until(server.all_blocks_free)


def test_truncation_auto_drops_the_oldest_items_until_the_output_fits(server):
    """truncation "auto" (was a 400): the instructions stay and the fewest oldest items go (a function_call_output
    whose call went goes with it) for the prompt to leave max_output_tokens in the 1024-token context; the answer is
    chat's on what is left, found here by rendering each tail through /tokenize. "disabled" (the default): a 400."""
    limit, turn = 1024 - 8, "word " * 120
    items = [{"role": "user", "content": "What time is it?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"tz": "UTC"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    for i in range(5):
        items += [{"role": "user", "content": f"{i} {turn}"}, {"role": "assistant", "content": f"ok {i} {turn}"}]
    items.append({"role": "user", "content": "Say hello."})
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024") as e:
        _create(server, instructions="Be brief.", input=items, **GREEDY)
    assert e.value.code == "context_length_exceeded"
    response = _create(server, instructions="Be brief.", input=items, truncation="auto", **GREEDY)
    assert response.truncation == "auto"

    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_time", "arguments": '{"tz": "UTC"}'}}]}
    messages = [items[0], call, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}, *items[3:]]
    system = {"role": "system", "content": "Be brief."}
    with server.http() as http:
        def prompt_tokens(tail):
            body = {"model": server.model_name, "messages": [system, *tail]}
            return http.post("/tokenize", json=body).json()["count"]

        starts = [k for k, m in enumerate(messages) if m["role"] != "tool"]  # a tail never opens with a tool output
        kept = next(messages[k:] for k in starts if prompt_tokens(messages[k:]) <= limit)
        assert kept[0]["content"].startswith("ok ") and len(kept) < len(messages) - 3  # some turns went too
        assert response.usage.input_tokens == prompt_tokens(kept)
        assert response.output_text == _chat_text(server, [system, *kept])

        # the call with its output: a question too long to follow the call, short enough to follow its output alone
        def question(n):
            return {"role": "user", "content": "word " * n}
        n = next(n for n in range(limit - 60, limit) if prompt_tokens([*messages[1:3], question(n)]) > limit)
        assert prompt_tokens(messages[2:3] + [question(n)]) <= limit  # what keeping the orphaned output would send
        pair = _create(server, instructions="Be brief.", input=[*items[:3], question(n)], truncation="auto", **GREEDY)
        assert pair.usage.input_tokens == prompt_tokens([question(n)])
    server.wait_until(server.all_blocks_free)
