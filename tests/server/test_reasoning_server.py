"""`fxrewrite serve --reasoning-parser qwen3` end to end: a real server over the tiny Qwen3 (whose vocabulary has
Qwen3's <think> and </think> tokens); the model's text is forced with guided_regex, as the tool-call tests do."""

import json

import httpx
import pytest
from tests.server.conftest import API_KEY, MODEL_NAME, cli_server

import xgrammar  # noqa: E402,F401 - the serve extra (`make setup` installs it): missing is a setup fault

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
THOUGHT = r"<think>Let me see\.</think>\n\nParis\."
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC"]}}, "required": ["tz"]}}}
CALL = r'<think>A tool\.</think>\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def thinking(tiny_model_dir):
    """(base URL, serving chat) of a server started with --reasoning-parser qwen3, as `fxrewrite serve` starts it."""
    with cli_server(tiny_model_dir("qwen3"), "--enable-auto-tool-choice", "--reasoning-parser", "qwen3") as running:
        yield running[0], running[2].state.serving_chat


def _chat(url, regex, stream=False, **body):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 100,
            "stream": stream, "structured_outputs": {"regex": regex}, **body}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=600)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["message"]
    message = {"reasoning": "", "reasoning_content": "", "content": "", "tool_calls": []}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                assert not ("reasoning" in delta and delta.get("content")), "reasoning and content in one delta"
                for key in ("reasoning", "reasoning_content", "content"):
                    message[key] += delta.get(key) or ""
                message["tool_calls"] += delta.get("tool_calls") or []
    return message


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_content(thinking, stream):
    url, _ = thinking
    message = _chat(url, THOUGHT, stream)
    assert message["reasoning"] == message["reasoning_content"] == "Let me see."
    assert message["content"] == "\n\nParis."


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_from_the_content_only(thinking, stream):
    url, _ = thinking
    message = _chat(url, CALL, stream, tools=[TOOL])
    assert message["reasoning"] == "A tool."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"], message
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"tz": "UTC"}
    assert (message["content"] or "").strip() == ""


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_under_an_output_constraint(thinking, stream, monkeypatch):
    """Unconstrained, deepseek_r1 starts in the reasoning (test_reasoning_parser.py); a constrained reply (and
    only a constraint makes this random model write chosen text) is reasoning only in a think block it writes."""
    from fxrewrite.runtime.server.reasoning import REASONING_PARSERS

    url, chat = thinking
    monkeypatch.setattr(chat, "reasoning_parser", REASONING_PARSERS["deepseek_r1"])
    message = _chat(url, r"<think>Hmm, one</think>Two\.", stream)
    assert (message["reasoning"], message["content"]) == ("Hmm, one", "Two.")
    # without </think> the grammar wrote the whole reply: content (parser_for_request), not reasoning
    message = _chat(url, r"Only an answer\.", stream)
    assert not message["reasoning"] and message["content"] == "Only an answer."


def test_completions_are_not_parsed(thinking):
    url, _ = thinking
    body = {"model": MODEL_NAME, "prompt": "Capital of France?", "max_tokens": 100,
            "structured_outputs": {"regex": THOUGHT}}
    out = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=600).json()
    assert out["choices"][0]["text"] == "<think>Let me see.</think>\n\nParis."
