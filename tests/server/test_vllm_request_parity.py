"""Request handling as vLLM's server does it, against the real test server (tiny Qwen3): whole-number floats
taken for integer fields (2.0 is 2; 2.5 and "2" are 400s), any temperature >= 0, and every response naming
the first served name whichever alias the request asked for (vLLM's `OpenAIServingModels.model_name()`); vLLM's
/tokenize and /detokenize paths, its logprobs shapes (`logprobs: 0`, `return_tokens_as_token_ids`),
`truncate_prompt_tokens` and `continuous_usage_stats`."""

import json

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
ALIAS = "tiny-alias"


def _post(server, path, body):
    with server.http() as http:
        return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _chunks(response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_whole_number_floats_are_integers(server):
    ids = [float(t) for t in server.engine.tokenizer.encode("Hello there")]
    body = COMPLETION | {"max_tokens": 3.0, "n": 2.0, "seed": 5.0, "top_k": 1.0, "min_tokens": 3.0,
                         "logprobs": 1.0, "ignore_eos": True, "prompt": ids}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 6
    assert all(len(c["logprobs"]["top_logprobs"][0]) == 1 for c in out["choices"])
    r = _post(server, "/v1/chat/completions", CHAT | {"max_completion_tokens": 2.0, "logprobs": True,
                                                       "top_logprobs": 2.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 2 and len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize("path, body, field, shown", [
    ("/v1/completions", COMPLETION | {"max_tokens": 2.5}, "max_tokens", "2.5"),
    ("/v1/completions", COMPLETION | {"n": "2"}, "n", '"2"'),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 1.5}, "max_completion_tokens", "1.5"),
    ("/v1/chat/completions", CHAT | {"seed": 0.5}, "seed", "0.5"),
    ("/v1/detokenize", {"tokens": [1.5]}, "tokens", "1.5"),
])
def test_fractional_numbers_and_strings_are_not_integers(server, path, body, field, shown):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    assert "expected an integer" in error["message"] and shown in error["message"], error


def test_temperature_has_no_upper_bound(server):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = _post(server, path, body | {"temperature": 3})
        assert r.status_code == 200, r.text
    with server.http() as http:  # Python's JSON reader takes Infinity; it is no temperature
        r = http.post("/v1/completions", content='{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}',
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    assert "finite" in r.json()["error"]["message"]


@pytest.fixture
def aliased(server, monkeypatch):
    """The test server serving a second name, as `--served-model-name tiny-qwen3 tiny-alias` would."""
    for handler in (server.app.state.serving_chat, server.app.state.serving_completion):
        monkeypatch.setattr(handler, "served_model_names", [server.model_name, ALIAS])
    return server


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_an_alias_is_answered_with_the_first_served_name(aliased, path, body, stream):
    r = _post(aliased, path, body | {"model": ALIAS, "stream": stream})
    assert r.status_code == 200, r.text
    models = {chunk["model"] for chunk in _chunks(r)} if stream else {r.json()["model"]}
    assert models == {aliased.model_name}
    r = _post(aliased, path, body | {"model": "not-served"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_tokenize_and_detokenize_are_served_at_vllms_root_paths(server):
    """vLLM serves POST /tokenize and /detokenize (no /v1 prefix); clients built for it call those paths."""
    for prefix in ("", "/v1"):
        tokens = _post(server, f"{prefix}/tokenize", {"prompt": "Hello world"})
        assert tokens.status_code == 200, (prefix, tokens.text)
        back = _post(server, f"{prefix}/detokenize", {"tokens": tokens.json()["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}, (prefix, back.text)
        keyless = httpx.post(f"{server.base_url}{prefix}/tokenize", json={"prompt": "hi"}, timeout=30)
        assert keyless.status_code == 401, (prefix, keyless.text)


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_0_gives_each_tokens_own_logprob(server, echo):
    """logprobs=0 asks for no alternatives, but each position's top_logprobs still holds its own token (vLLM's
    `num_output_top_logprobs >= i` over a dict that starts with that token; OpenAI's "logprobs + 1")."""
    r = _post(server, "/v1/completions", COMPLETION | {"prompt": "One two three", "logprobs": 0, "echo": echo,
                                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    positions = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[1 if echo else 0:]
    assert len(positions) >= 2 and all(top == {token: logprob} for token, logprob, top in positions), lp


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_tokens_by_id(server, stream):
    """vLLM's `return_tokens_as_token_ids`: every token in logprobs (sampled, top and echoed) is "token_id:<id>",
    so an RL client gets the exact ids back; the text is unchanged."""
    ids = server.engine.tokenizer.encode("One two")
    body = COMPLETION | {"prompt": ids, "logprobs": 1, "echo": True, "ignore_eos": True, "seed": 1, "stream": stream}
    r = _post(server, "/v1/completions", body | {"return_tokens_as_token_ids": True})
    tokens, tops, text = [], [], ""
    for choice in [c["choices"][0] for c in _chunks(r)] if stream else [r.json()["choices"][0]]:
        tokens += choice["logprobs"]["tokens"]
        tops += [t for t in choice["logprobs"]["top_logprobs"] if t]
        text += choice["text"]
    assert tokens[:2] == [f"token_id:{i}" for i in ids] and len(tokens) == 4, tokens
    assert all(k.startswith("token_id:") for top in tops for k in top), tops
    plain = _post(server, "/v1/completions", body | {"stream": False}).json()["choices"][0]
    assert text == plain["text"]
    chat = _post(server, "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 2,
                                                         "return_tokens_as_token_ids": True}).json()["choices"][0]
    for t in chat["logprobs"]["content"]:
        assert t["token"].startswith("token_id:") and t["bytes"] == list(t["token"].encode())
        assert all(top["token"].startswith("token_id:") for top in t["top_logprobs"])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens are the prompt (-1: the last max_model_len);
    0 or more than max_model_len is a 400 naming the field."""
    ids = server.engine.tokenizer.encode("One two three four five six")
    body = COMPLETION | {"temperature": 0, "echo": True, "logprobs": 0}
    cut = _post(server, "/v1/completions", body | {"prompt": ids, "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 2 and cut["choices"][0]["logprobs"]["tokens"][:2] == [
        server.engine.tokenizer.decode([i]) for i in ids[-2:]]
    alone = _post(server, "/v1/completions", body | {"prompt": ids[-2:]}).json()
    assert cut["choices"][0]["text"] == alone["choices"][0]["text"]
    text = _post(server, "/v1/completions", body | {"prompt": "One two three four five six",
                                                    "truncate_prompt_tokens": 2})
    assert text.json()["choices"][0]["text"] == alone["choices"][0]["text"], text.text
    assert _post(server, "/v1/completions", COMPLETION | {"truncate_prompt_tokens": -1}).status_code == 200
    chat = _post(server, "/v1/chat/completions", CHAT | {"truncate_prompt_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 3, chat
    for bad in (0, server.max_model_len + 1):
        r = _post(server, "/v1/completions", COMPLETION | {"truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, path, body):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): each chunk's usage counts the prompt
    and its choice's tokens so far; the last chunk still carries the whole usage. Without it, chunks carry none."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = body | {"stream": True, "stream_options": options, "max_tokens": 4, "ignore_eos": True, "n": 2}
    chunks = _chunks(_post(server, path, request))
    *deltas, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8, final
    prompt = final["usage"]["prompt_tokens"]
    seen = {}
    for c in deltas:
        usage, index = c["usage"], c["choices"][0]["index"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"], c
        assert usage["completion_tokens"] >= seen.get(index, 0)
        seen[index] = usage["completion_tokens"]
    assert seen == {0: 4, 1: 4}
    plain = _chunks(_post(server, path, request | {"stream_options": {"include_usage": True}}))
    assert all(c["usage"] is None for c in plain[:-1])


def test_add_special_tokens_is_passed_to_the_tokenizer(server, monkeypatch):
    """vLLM's add_special_tokens: completions default True (the tokenizer's BOS around a text prompt), chat
    default False (the template wrote them); either way the request's value reaches the tokenizer. The tiny
    tokenizer adds nothing, so a stand-in adds one token (id 1) when asked."""
    tokenizer = server.engine.tokenizer
    encode = tokenizer.encode

    def with_bos(text, *args, add_special_tokens=True, **kwargs):
        ids = list(encode(text, *args, add_special_tokens=False, **kwargs))
        return [1] + ids if add_special_tokens else ids

    monkeypatch.setattr(tokenizer, "encode", with_bos)

    def prompt_tokens(path, body):
        with server.http() as http:
            r = http.post(path, json={"model": server.model_name, "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    completion = {"prompt": "hello there"}
    assert prompt_tokens("/v1/completions", completion) == \
        prompt_tokens("/v1/completions", completion | {"add_special_tokens": False}) + 1
    chat = {"messages": [{"role": "user", "content": "hello there"}]}
    assert prompt_tokens("/v1/chat/completions", chat | {"add_special_tokens": True}) == \
        prompt_tokens("/v1/chat/completions", chat) + 1
