"""LLM.chat's vLLM options: continue_final_message (the last assistant message is left open to be
continued) and tools (given to the model's chat template), on the tiny Qwen3 with Qwen3's real template;
and the progress bar honouring tqdm's TQDM_DISABLE."""

import pytest

from fxrewrite import LLM, SamplingParams

PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
GREEDY = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    return LLM(str(tiny_qwen3_dir), kv_cache_memory_bytes=1 << 22, max_model_len=512)


def _prompt_text(llm, out):
    return llm.get_tokenizer().decode(out[0].prompt_token_ids)


def test_continue_final_message_leaves_the_assistant_message_open(llm):
    out = llm.chat(PREFILL, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    text = _prompt_text(llm, out)
    assert text.endswith("My answer is"), text  # no <|im_end|>, no new assistant header
    closed = _prompt_text(llm, llm.chat(PREFILL, GREEDY, use_tqdm=False, add_generation_prompt=False))
    assert closed.rstrip().endswith("<|im_end|>") and closed.startswith(text)
    assert len(out[0].outputs[0].token_ids) == 3


def test_chat_output_prompt_is_the_rendered_text(llm):
    # vLLM's LLM.chat renders the conversation to text, so RequestOutput.prompt is that text, not None
    outs = llm.chat([PREFILL, PREFILL[:1]], GREEDY, use_tqdm=False, add_generation_prompt=False)
    tokenizer = llm.get_tokenizer()
    for out, conversation in zip(outs, [PREFILL, PREFILL[:1]]):
        expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
        assert out.prompt == expected
        assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_continue_final_message_refuses_a_generation_prompt_and_continues_any_role(llm):
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(PREFILL, GREEDY, use_tqdm=False, continue_final_message=True)
    out = llm.chat(PREFILL[:1], GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert _prompt_text(llm, out).endswith(PREFILL[0]["content"])  # the user's turn left open, as transformers
    assert not llm.llm_engine.has_unfinished_requests()


def test_tools_reach_the_chat_template(llm):
    with_tools = _prompt_text(llm, llm.chat(PREFILL[:1], GREEDY, use_tqdm=False, tools=TOOLS))
    plain = _prompt_text(llm, llm.chat(PREFILL[:1], GREEDY, use_tqdm=False))
    assert "get_forecast" in with_tools and "<tools>" in with_tools and "get_forecast" not in plain
    expected = llm.get_tokenizer().apply_chat_template(PREFILL[:1], tools=TOOLS, tokenize=False,
                                                       add_generation_prompt=True)
    assert with_tools == expected


def test_tools_with_a_template_that_ignores_them_are_refused(llm):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="cannot render tools"):
        llm.chat(PREFILL[:1], GREEDY, use_tqdm=False, tools=TOOLS, chat_template=template)
    with pytest.raises(TypeError, match="tools must be a list"):
        llm.chat(PREFILL[:1], GREEDY, use_tqdm=False, tools={"name": "x"})
    for bad in ({"type": "function"}, {"type": "function", "function": {"parameters": {}}},
                {"type": "retrieval", "function": {"name": "x"}}):  # the template rendered a tool without a function
        with pytest.raises(ValueError, match=r"tools\[1\]=.*expected \{'type': 'function', 'function'"):
            llm.chat(PREFILL[:1], GREEDY, use_tqdm=False, tools=[TOOLS[0], bad])


def test_progress_bar_is_shown_unless_use_tqdm_is_false(llm, capsys):
    llm.generate(["hi"], GREEDY)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["hi"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_progress_bar_honours_tqdm_disable(llm, monkeypatch, capsys):
    """tqdm applies TQDM_* as defaults of its keyword arguments when it is imported (tqdm.utils.envwrap), so
    the bar class is rebuilt here as tqdm builds it in a process started with TQDM_DISABLE=1: the bar is off
    although use_tqdm=True (an explicit disable=False would override the variable)."""
    import tqdm.auto
    import tqdm.std
    from tqdm.utils import envwrap

    monkeypatch.setenv("TQDM_DISABLE", "1")
    original_init = tqdm.std.tqdm.__dict__["__init__"].func  # tqdm's __init__ before the env wrap
    env_tqdm = type("EnvTqdm", (tqdm.auto.tqdm,), {"__init__": envwrap("TQDM", is_method=True)(original_init)})
    assert env_tqdm(total=1).disable  # tqdm's own handling of the variable
    monkeypatch.setattr(tqdm.auto, "tqdm", env_tqdm)
    llm.generate(["hi"], GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err


def test_chat_template_path_or_text_and_content_types(llm, tmp_path):
    convo = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"chat_template '/nonexistent/t.jinja': no such file"):
        llm.chat(convo, GREEDY, use_tqdm=False, chat_template="/nonexistent/t.jinja")  # not used as the text
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    by_path = llm.chat(convo, GREEDY, use_tqdm=False, chat_template=str(path))[0]
    assert by_path.prompt == "<hi>"
    with pytest.raises(TypeError, match=r"message 0: content=5 must be a string or a list of content parts"):
        llm.chat([{"role": "user", "content": 5}], GREEDY, use_tqdm=False)


def test_text_content_parts_are_joined_as_the_server_joins_them(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]}]
    joined = [{"role": "user", "content": "Name a\ncolour."}]
    got, want = (llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (parts, joined))
    assert got.prompt == want.prompt and got.outputs[0].token_ids == want.outputs[0].token_ids
    other = [{"role": "user", "content": [{"type": "input_text", "text": "Name a"},
                                          {"type": "text", "text": "colour."}]}]
    assert llm.chat(other, GREEDY, use_tqdm=False)[0].prompt == want.prompt  # vLLM's text-like parts are text too
    refusal = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "Ok"}]
    assert "No." in llm.chat(refusal, GREEDY, use_tqdm=False)[0].prompt
    for content, error in [([], r"conversation 0 message 0.content is an empty list"),
                           ([{"type": "text"}], r"message 0.content\[0\].text must be a string, got None"),
                           ([{"type": "image_url", "image_url": {"url": "x"}}], r"only text .* got type 'image_url'")]:
        with pytest.raises(ValueError, match=error):
            llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    assert llm.chat(joined, GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_an_assistant_turns_reasoning_reaches_the_template_under_both_names(llm):
    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.get('reasoning_content', '-') }}|"
                "{{ m.get('reasoning', '-') }};{% endfor %}")
    convo = [{"role": "user", "content": "x", "reasoning": "u"},
             {"role": "assistant", "content": "A", "reasoning": "R"}]
    text = llm.chat(convo, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)[0].prompt
    assert text == "user:-|-;assistant:R|R;"  # as vLLM passes it (Qwen3's template reads reasoning_content)


def test_an_assistant_turn_of_only_tool_calls_renders_as_over_http(llm):
    call = {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": {"city": "Paris"}}}
    convo = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None,
                                                                  "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert "sunny" in llm.chat(convo, GREEDY, use_tqdm=False, tools=TOOLS)[0].prompt
    concat = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }};{% endfor %}"  # as SmolLM2's reads it
    text = llm.chat(convo, GREEDY, use_tqdm=False, chat_template=concat)[0].prompt
    assert text == "user: Weather in Paris?;assistant: ;tool: sunny;"


def test_allowed_token_ids_restrict_sampling(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, allowed_token_ids=[11, 12], ignore_eos=True)
    assert set(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) <= {11, 12}
    with pytest.raises(ValueError, match=r"allowed_token_ids token id 999999 is out of range"):
        llm.generate([[5]], SamplingParams(allowed_token_ids=[999999]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids token id 999999 is out of range \[0, "):
        llm.generate([[5]], SamplingParams(stop_token_ids=[999999]), use_tqdm=False)
    assert llm.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still serving
    with pytest.raises(TypeError, match=r"allowed_token_ids=\[\] must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])


def test_chat_and_sampling_argument_types(llm):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict, got str"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template_kwargs="x")
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['messages'\]"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match=r"chat_template '\{% for %\}': not a valid Jinja template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template="{% for %}")
    with pytest.raises(TypeError, match=r"stop_token_ids='2' must be a list of integers"):
        SamplingParams(stop_token_ids="2")


def test_load_weights_and_wake_up_refuse_bad_arguments(llm):
    import torch

    name, param = next(iter(llm.llm_engine.model_runner.model.named_parameters()))
    with pytest.raises(TypeError, match="got str 'path'"):
        llm.load_weights("path")
    with pytest.raises(TypeError, match="has dtype torch.int64; expected a floating-point tensor"):
        llm.load_weights([(name, torch.zeros(param.shape, dtype=torch.int64))], strict=False)
    with pytest.raises(ValueError, match="wake_up: tags=\\['bogus'\\]"):
        llm.wake_up(["bogus"])


def test_a_template_whose_code_raises_is_a_value_error_naming_it(llm):
    """A Python error inside the template's own code (here `content + '!'` on the list of parts that
    chat_template_content_format="openai" gives it) was a bare TypeError "can only concatenate str (not "list")
    to str" out of jinja; as in vLLM it is a ValueError, here naming the template and the error."""
    template = "{% for m in messages %}{{ m['content'] + '!' }}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    with pytest.raises(ValueError, match=r"conversation 0: chat template failed: TypeError: can only concatenate"):
        llm.chat(parts, GREEDY, chat_template=template, chat_template_content_format="openai", use_tqdm=False)
    assert llm.chat(parts, GREEDY, chat_template=template, use_tqdm=False)[0].prompt == "Hi!"  # "string": joined


def test_tool_call_arguments_reach_the_template_as_dicts(llm):
    """LLM.chat gave an assistant tool call's `arguments` (OpenAI's JSON string) to the template as the string:
    a template writing `arguments | tojson` (Llama 3.1's) got it double-encoded, and Qwen3's printed an empty one
    as `"arguments": }`. As vLLM and the server do, they are parsed (empty: {}); the caller's dicts unchanged."""
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};" \
               "{% endfor %}{% endfor %}"
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    out = llm.chat(messages, GREEDY, chat_template=template, add_generation_prompt=False, use_tqdm=False)
    assert out[0].prompt == '{"city": "Paris"};{};'
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    calls[1]["function"]["arguments"] = "{bad"
    with pytest.raises(ValueError, match=r"message 1 tool_calls\[1\]\.function\.arguments='\{bad' is not JSON"):
        llm.chat(messages, GREEDY, chat_template=template, add_generation_prompt=False, use_tqdm=False)
