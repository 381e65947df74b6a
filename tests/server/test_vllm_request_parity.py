"""Request handling as vLLM's server does it, against the real test server (tiny Qwen3): whole-number floats
taken for integer fields (2.0 is 2; 2.5 and "2" are 400s), any temperature >= 0, and every response naming
the first served name whichever alias the request asked for (vLLM's `OpenAIServingModels.model_name()`)."""

import json

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
