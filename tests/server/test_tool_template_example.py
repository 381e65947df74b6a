"""The README's tool-calling recipe for the default model: its own (SmolLM2) chat template ignores
`tools`, so a tools request is a 400 saying so; `fxrewrite serve --chat-template
examples/tool_chat_template_hermes.jinja --enable-auto-tool-choice` renders them, "auto" picks the hermes
parser from the template, and calls come back as OpenAI tool_calls. A tiny Llama folder carries the
default model's real tokenizer and template."""

import json
from pathlib import Path

import pytest

import xgrammar  # noqa: E402,F401 - the serve extra (`make setup` installs it): missing is a setup fault

EXAMPLE_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_hermes.jinja"
TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What time is it in Paris?"}]


@pytest.fixture(scope="module")
def serve_args(tiny_llama_dir):
    from fxrewrite.cli import build_parser

    return build_parser().parse_args([
        "serve", str(tiny_llama_dir), "--model-impl", "native", "--max-model-len", "512",
        "--kv-cache-memory-bytes", "2M", "--chat-template", str(EXAMPLE_TEMPLATE), "--enable-auto-tool-choice"])


def test_example_template_serves_tools_where_the_default_template_cannot(serve_args):
    from fastapi.testclient import TestClient

    from fxrewrite.commands.serve import build_server_app
    from fxrewrite.runtime.server.api_server import build_app

    engine, app = build_server_app(serve_args)
    named = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 24,
             "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    own_template = TestClient(build_app(engine)).post("/v1/chat/completions", json=named)  # refused before queueing
    assert own_template.status_code == 400, own_template.text
    error = own_template.json()["error"]
    assert "cannot render tools" in error["message"] and "--chat-template" in error["message"]
    assert error["param"] == "tools"
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json=named)
        assert response.status_code == 200, response.text
        call = response.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_time" and json.loads(call["arguments"]) in ({"tz": "UTC"}, {"tz": "CET"})
        response = client.post("/v1/chat/completions", json=named | {"tool_choice": "auto", "max_tokens": 2})
        assert response.status_code == 200, response.text  # "auto": the hermes parser, picked by the template
    with TestClient(build_app(engine)) as client:  # tool_choice "none" wants text: rendered without the tools
        response = client.post("/v1/chat/completions", json=named | {"tool_choice": "none", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert not response.json()["choices"][0]["message"].get("tool_calls")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_example_template_renders_tools_calls_and_results(tiny_llama_dir):
    from transformers import AutoTokenizer

    from fxrewrite.runtime.server.tool_parsers import HermesToolParser, get_tool_parser

    template = EXAMPLE_TEMPLATE.read_text()
    assert isinstance(get_tool_parser("auto", template), HermesToolParser)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert "tools" not in tokenizer.chat_template  # the default model's own template ignores them
    arguments = {"city": "Paris", "days": 2}
    messages = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                         chat_template=template)
    assert all(json.dumps(tool["function"]) in text for tool in TOOLS)
    replayed = text[text.index("<|im_start|>assistant"):]
    _, calls = HermesToolParser().parse(replayed[:replayed.index("<|im_end|>")])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_forecast", arguments)]
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))[0] == "<|im_start|>"
