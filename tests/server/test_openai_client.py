"""The official openai client, unchanged, against a real server: chat and completions, streamed or not."""

import pytest
import torch


PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_models_health_version(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [server.model_name]
    with server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ping").status_code == http.post("/ping").status_code == 200  # vLLM's SageMaker route
        assert http.get("/version").json()["version"]


def test_health_is_503_once_the_model_cannot_run(server, monkeypatch):
    """A dead tensor-parallel worker makes `check_health` raise: /health must say so (a supervisor
    restarts the server), in OpenAI's error shape."""
    from fxrewrite.runtime.worker.executor import WorkerError

    def dead():
        raise WorkerError("the tensor-parallel workers are shut down (worker 1 killed)")

    monkeypatch.setattr(server.engine.model_runner, "check_health", dead, raising=False)
    with server.http() as http:
        response = http.get("/health")
        assert http.get("/ping").status_code == 503
    assert response.status_code == 503
    assert "worker 1 killed" in response.json()["error"]["message"]
    monkeypatch.undo()
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_completion_stream_equals_non_stream(server):
    client = server.client()
    full = client.completions.create(model=server.model_name, prompt=PROMPT, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_stream_equals_non_stream(server):
    client = server.client()
    messages = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=server.model_name, messages=messages, **GREEDY)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.usage.completion_tokens == 12

    stream = client.chat.completions.create(model=server.model_name, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_max_completion_tokens_and_stop(server):
    client = server.client()
    messages = [{"role": "user", "content": "Count."}]
    base = client.chat.completions.create(model=server.model_name, messages=messages, temperature=0,
                                          max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert base.usage.completion_tokens == 5
    text = base.choices[0].message.content
    # A stop string from the middle of the text (not only blanks, so the check can never be skipped).
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip())
    stopped = client.chat.completions.create(model=server.model_name, messages=messages, temperature=0,
                                             max_completion_tokens=5, stop=[stop],
                                             extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_several_prompts_n_and_token_ids(server):
    client = server.client()
    out = client.completions.create(model=server.model_name, prompt=["One", "Two"], n=2, temperature=0.8, seed=3,
                                    max_tokens=4, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    ids = server.engine.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=server.model_name, prompt=ids, **GREEDY)
    by_text = client.completions.create(model=server.model_name, prompt=PROMPT, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_seed_makes_sampling_repeatable(server):
    client = server.client()
    kwargs = dict(model=server.model_name, prompt=PROMPT, temperature=1.0, top_p=0.9, seed=1234, max_tokens=8,
                  extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    first = client.completions.create(**kwargs).choices[0].text
    # other seeds sample other texts (an ignored seed with deterministic decoding would repeat too, and fail here)
    others = [client.completions.create(**{**kwargs, "seed": seed}).choices[0].text for seed in (1, 2, 3, 4)]
    assert len({first, *others}) >= 2, others
    # the same seed again, after the other seeds' requests: the same text
    assert client.completions.create(**kwargs).choices[0].text == first


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir):
    """transformers' own model of the server's checkpoint (the same folder: `tiny_model_dir("qwen3")`), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)


TOL = {"rel": 1e-5, "abs": 1e-5}
"""float32 on both sides (the server's dtype "auto" is the checkpoint's float32)."""


def _oracle(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(ids), vocab]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _token_id(name: str) -> int:
    assert name.startswith("token_id:"), name  # return_tokens_as_token_ids
    return int(name.removeprefix("token_id:"))


def _tokenize(server, **body) -> list[int]:
    with server.http() as http:
        r = http.post("/tokenize", json={"model": server.model_name, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs(server, hf_model, stream):
    assert server.engine.model_config.dtype == torch.float32
    client = server.client()
    messages = [{"role": "user", "content": "Hi"}]

    def chat(**extra):
        out = client.chat.completions.create(model=server.model_name, messages=messages, logprobs=True,
                                             top_logprobs=2, stream=stream,
                                             **{**GREEDY, "extra_body": {**GREEDY["extra_body"], **extra}})
        chunks = list(out) if stream else [out]
        return [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]

    content, by_id = chat(), chat(return_tokens_as_token_ids=True)
    assert len(content) == len(by_id) == 12
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        # greedy: the sampled token is the most likely one
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-4)
    # the same greedy request with its tokens named by id: the same numbers
    assert [(t.logprob, [x.logprob for x in t.top_logprobs]) for t in by_id] == \
        [(t.logprob, [x.logprob for x in t.top_logprobs]) for t in content]
    prompt = _tokenize(server, messages=messages)  # the chat template's rendering, as the chat endpoint's
    generated = [_token_id(t.token) for t in by_id]
    ref = _oracle(hf_model, prompt + generated)
    for j, token in enumerate(by_id):
        row = ref[len(prompt) - 1 + j]
        assert token.logprob == pytest.approx(row[generated[j]].item(), **TOL), j
        assert [x.logprob for x in token.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), **TOL), j
        assert _token_id(token.top_logprobs[0].token) == generated[j]

    comp = client.completions.create(model=server.model_name, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == comp.choices[0].text
    ids = client.completions.create(model=server.model_name, prompt=PROMPT, logprobs=3,
                                    **{**GREEDY, "extra_body": {**GREEDY["extra_body"],
                                                                "return_tokens_as_token_ids": True}})
    lp_ids = ids.choices[0].logprobs
    assert lp_ids.token_logprobs == lp.token_logprobs
    assert [sorted(t.values()) for t in lp_ids.top_logprobs] == [sorted(t.values()) for t in lp.top_logprobs]
    prompt = _tokenize(server, prompt=PROMPT)
    generated = [_token_id(t) for t in lp_ids.tokens]
    ref = _oracle(hf_model, prompt + generated)
    for j, (token_lp, top) in enumerate(zip(lp_ids.token_logprobs, lp_ids.top_logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert token_lp == pytest.approx(row[generated[j]].item(), **TOL), j
        best = row.topk(3)
        # the 3 most likely, plus the sampled token when it is not among them (greedy: it always is)
        outside = generated[j] not in best.indices.tolist()
        assert len(top) == 3 + outside, (j, top)
        assert f"token_id:{generated[j]}" in top and top[f"token_id:{generated[j]}"] == token_lp
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best.values.tolist(), **TOL), j


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 1.0, "seed": 7, "max_tokens": 12,
                                               "extra_body": {"ignore_eos": True}}], ids=["greedy", "seeded"])
def test_echo(server, sampling):
    client = server.client()
    plain = client.completions.create(model=server.model_name, prompt=PROMPT, **sampling).choices[0]
    echoed = client.completions.create(model=server.model_name, prompt=PROMPT, echo=True, **sampling).choices[0]
    assert plain.text and echoed.text == PROMPT + plain.text
    assert echoed.finish_reason == plain.finish_reason == "length"


def test_streamed_choices_of_several_prompts_match_non_streamed(server):
    client = server.client()
    kwargs = dict(model=server.model_name, prompt=["One", "Two"], n=2, temperature=0.8, seed=11, max_tokens=5,
                  extra_body={"ignore_eos": True})
    full = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == full
