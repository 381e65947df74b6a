"""The OpenAI surface beyond plain generation, through the real `openai` client against the test server
(tiny Qwen3, Qwen3's real tokenizer and chat template, `--enable-auto-tool-choice`): echo + logprobs as
lm-eval's loglikelihood requests send them, prompt_logprobs, top_logprobs with n > 1, best_of, seed,
logit_bias, bad_words, stop_token_ids, tokenize / detokenize, and bad input."""

import httpx
import openai
import pytest
import torch

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)


def test_lm_eval_loglikelihood_request_shape(server, hf_model):
    """lm-eval's LocalCompletionsAPI: prompts as token-id lists, max_tokens=1, logprobs=1, echo=True; it
    sums token_logprobs[ctxlen:-1] and checks greediness against top_logprobs."""
    tok = server.engine.tokenizer
    context, continuation = tok.encode("The capital of France is"), tok.encode(" Paris, of course")
    prompts = [context + continuation, context[:3] + continuation]
    out = server.client().completions.create(model=server.model_name, prompt=prompts, max_tokens=1, logprobs=1,
                                             echo=True, temperature=0, seed=1234)
    assert server.engine.model_config.dtype == torch.float32 == hf_model.dtype  # float32 on both sides
    assert len(out.choices) == len(prompts)
    assert sorted(c.index for c in out.choices) == list(range(len(prompts)))
    for choice, prompt in zip(sorted(out.choices, key=lambda c: c.index), prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and all(isinstance(t, dict) for t in lp.top_logprobs[1:])
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        expected = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, rel=1e-5, abs=1e-5)
        ctxlen = len(prompt) - len(continuation)
        for token_lp, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]):
            assert max(top.values()) >= token_lp - 1e-6
        assert choice.text.startswith(tok.decode(prompt))
        assert lp.text_offset[: len(prompt)] == sorted(lp.text_offset[: len(prompt)])


def test_echo_top_logprobs_include_the_prompt_token(server):
    """OpenAI and vLLM put each position's actual token in its top_logprobs, even when it is not in the
    top k (a random tiny model ranks most prompt tokens low)."""
    tok = server.engine.tokenizer
    prompt = tok.encode("zebra quantum marmalade xylophone")
    out = server.client().completions.create(model=server.model_name, prompt=prompt, max_tokens=1, logprobs=1,
                                             echo=True, temperature=0)
    lp = out.choices[0].logprobs
    for text, token_lp, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[text] == pytest.approx(token_lp) and 1 <= len(top) <= 2


def test_unknown_role_message_has_no_stray_prefix(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("messages[0].role: role 'wizard' is not one of"), message


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server):
    out = server.client().completions.create(model=server.model_name, prompt="Hello there", max_tokens=0,
                                             echo=True, logprobs=0)
    assert out.choices[0].text == "Hello there" and out.usage.completion_tokens == 0
    assert len(out.choices[0].logprobs.tokens) == out.usage.prompt_tokens


def test_prompt_logprobs_over_http(server):
    body = {"model": server.model_name, "prompt": "One two three four", "max_tokens": 1, "prompt_logprobs": 2}
    with server.http() as http:
        data = http.post("/v1/completions", json=body).json()
    pl = data["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == data["usage"]["prompt_tokens"]
    assert all(2 <= len(step) <= 3 and all("logprob" in v and "rank" in v for v in step.values()) for step in pl[1:])


def test_chat_top_logprobs_with_n_2(server):
    out = server.client().chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


def test_best_of_seed_logit_bias_bad_words(server):
    client = server.client()
    kw = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    best = client.completions.create(n=2, seed=3, **{**kw, "extra_body": {"ignore_eos": True, "best_of": 4}})
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    tok = server.engine.tokenizer
    forced = tok.encode(" Paris", add_special_tokens=False)[0]
    out = client.completions.create(logit_bias={str(forced): 100}, temperature=0, **kw)
    assert out.choices[0].text == " Paris" * 6
    out = client.completions.create(logit_bias={str(forced): 100}, temperature=0,
                                    **{**kw, "extra_body": {"ignore_eos": True, "bad_words": ["Paris"]}})
    assert "Paris" not in out.choices[0].text


def test_allowed_token_ids(server):
    client = server.client()
    tok = server.engine.tokenizer
    allowed = tok.encode(" yes no", add_special_tokens=False)
    out = client.completions.create(model=server.model_name, prompt="Once upon a time", max_tokens=5, temperature=1.0,
                                    extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                                "return_tokens_as_token_ids": False}, logprobs=0)
    ids = tok.encode(out.choices[0].text, add_special_tokens=False)
    assert ids and set(ids) <= set(allowed)
    for bad, message in (([10**9], "allowed_token_ids: token id 1000000000 is out of range"),
                         ([-1], "allowed_token_ids"), ([], "allowed_token_ids")):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.completions.create(model=server.model_name, prompt="x", extra_body={"allowed_token_ids": bad})
        assert e.value.param == "allowed_token_ids"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_name, prompt="x", extra_body={"stop_token_ids": [-1]})
    assert e.value.param == "stop_token_ids"


def test_stop_token_ids_text_left_out(server):
    client = server.client()
    kw = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    free = client.completions.create(extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False}, **kw)
    tok = server.engine.tokenizer
    ids = tok.encode(free.choices[0].text, add_special_tokens=False)
    stop = ids[2]
    out = client.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [stop]}, **kw)
    assert out.choices[0].stop_reason == stop
    assert tok.decode([stop]) not in out.choices[0].text[len(tok.decode(ids[:2])):]


def test_tokenize_and_detokenize(server):
    with server.http() as http:
        data = http.post("/v1/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert data["tokens"] == server.engine.tokenizer.encode("Hello world") and data["count"] == len(data["tokens"])
        assert data["max_model_len"] == server.max_model_len and len(data["token_strs"]) == data["count"]
        back = http.post("/v1/detokenize", json={"tokens": data["tokens"]}).json()
        assert back == {"prompt": "Hello world"}
        chat = http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert server.engine.tokenizer.decode(chat["tokens"]).startswith("<|im_start|>user\nhi")
        bad = http.post("/v1/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == "tokens" and "tokens: token id" in bad.json()["error"]["message"]
        both = http.post("/v1/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
        assert both.status_code == 400


def test_bad_input_is_a_400_naming_it(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="best_of cannot be used with stream"):
        client.completions.create(model=server.model_name, prompt="x", stream=True, extra_body={"best_of": 2})
    with pytest.raises(openai.BadRequestError, match="max_logprobs=20"):
        client.completions.create(model=server.model_name, prompt="x", extra_body={"prompt_logprobs": 50})
    # logprobs / top_logprobs follow the engine's max_logprobs (--max-logprobs), not a fixed cap
    with pytest.raises(openai.BadRequestError, match="logprobs=21 is more than max_logprobs=20"):
        client.completions.create(model=server.model_name, prompt="x", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logprobs=21 is more than max_logprobs=20"):
        client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logit_bias token id"):
        client.completions.create(model=server.model_name, prompt="x", logit_bias={"999999999": 1})
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 needs echo"):
        client.completions.create(model=server.model_name, prompt="x", max_tokens=0)
    assert server.all_blocks_free() or server.wait_until(server.all_blocks_free) is None


def test_request_logging_cuts_the_prompt(server, caplog):
    from fxrewrite.runtime.server.api_server import RequestLogger

    with caplog.at_level("INFO", logger="fxrewrite.requests"):
        RequestLogger(5).log("r1", "abcdefghij", "params")
        RequestLogger(3, server.engine.tokenizer).log("r2", server.engine.tokenizer.encode("Hello world"), "p")
    assert "'abcde'" in caplog.text and "abcdef" not in caplog.text
    assert "'Hel'" in caplog.text and "prompt_token_ids: [" in caplog.text
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_streamed_chat_deltas_carry_only_what_they_add(server):
    """As OpenAI and vLLM stream: the role once, then content alone (fresh-user report: "role": null and
    "tool_calls": null in every chunk)."""
    import json as _json

    body = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}
    with server.http() as http:
        lines = [line for line in http.post("/v1/chat/completions", json=body).text.splitlines()
                 if line.startswith("data: {")]
    deltas = [_json.loads(line[len("data: "):])["choices"][0]["delta"] for line in lines]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert len(deltas) > 1 and all(set(d) == {"content"} and isinstance(d["content"], str) for d in deltas[1:])


def test_prompt_ids_have_one_bound_offline_and_over_http(server):
    """A Qwen tokenizer has fewer tokens (151,669) than the model's vocabulary (151,936): both paths accept
    ids up to the model's (its embedding rows) and refuse the next one, naming the same range."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    vocab = server.engine.model_config.vocab_size
    assert len(server.engine.tokenizer) < vocab
    with server.http() as http:
        ok = http.post("/v1/completions", json={"model": server.model_name, "prompt": [vocab - 1], "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        bad = http.post("/v1/completions", json={"model": server.model_name, "prompt": [vocab], "max_tokens": 1})
        assert bad.status_code == 400 and f"out of range [0, {vocab})" in bad.json()["error"]["message"]
    with pytest.raises(ValueError, match=rf"out of range \[0, {vocab}\)"):
        server.engine.add_request("over", [vocab], SamplingParams(max_tokens=1))
