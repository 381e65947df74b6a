"""64 concurrent streams, clients that leave early, an engine error: blocks are freed, serving goes on."""

import asyncio
import json

import httpx
import pytest

NUM_CONCURRENT = 64
MAX_TOKENS = 8


def _prompts(n):
    return [f"Request number {i}: tell me about topic {i * 7 % 13}" for i in range(n)]


def test_64_concurrent_streams_complete_and_free_all_blocks(server):
    prompts = _prompts(NUM_CONCURRENT)
    greedy = dict(model=server.model_name, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    # Expected texts: the same prompts in one non-streamed request.
    expected = server.client().completions.create(prompt=prompts, **greedy)
    expected_texts = [c.text for c in sorted(expected.choices, key=lambda c: c.index)]
    most_running = []

    async def one(client, prompt):
        parts, reasons = [], []
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **greedy):
            parts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        return "".join(parts), reasons[-1]

    async def watch(done: asyncio.Event):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            while not done.is_set():
                text = (await http.get("/metrics")).text
                running = [line for line in text.splitlines() if line.startswith("fxrewrite:num_requests_running")]
                most_running.append(float(running[0].split()[-1]))
                await asyncio.sleep(0.1)

    async def run_all():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        async with server.async_client() as client:
            results = await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=120)
        done.set()
        await watcher
        return results

    results = asyncio.run(run_all())
    assert [r for _, r in results] == ["length"] * NUM_CONCURRENT
    assert [t for t, _ in results] == expected_texts
    assert max(most_running) > 1  # they really ran side by side
    server.wait_until(lambda: server.all_blocks_free())


def test_disconnect_mid_stream_frees_blocks_and_server_keeps_serving(server):
    before = server.scrape()
    body = {"model": server.model_name, "prompt": "A long story:", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with server.http() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
            assert len(events) >= 2
            # the request holds KV blocks while it streams
            assert server.scrape()["fxrewrite:num_free_blocks"] < before["fxrewrite:num_blocks"]
        # leaving the `with` closes the connection mid-stream
    server.wait_until(lambda: server.all_blocks_free())
    after = server.scrape()
    assert after["fxrewrite:request_aborted_total"] >= before["fxrewrite:request_aborted_total"] + 1
    assert after["fxrewrite:generation_tokens_total"] < before["fxrewrite:generation_tokens_total"] + 1000
    assert server.app.state.async_engine._joiner._requests == {}  # its joined outputs dropped too
    out = server.client().completions.create(model=server.model_name, prompt="Still there?", max_tokens=3,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_engine_error_fails_the_request_not_the_server(server, monkeypatch):
    runner = server.engine.model_runner
    original = runner.execute_model_async
    calls = {"n": 0}

    def fail_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected engine failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model_async", fail_once)
    client = server.client()
    import openai

    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=server.model_name, prompt="boom", max_tokens=3)
    assert "injected engine failure" in str(e.value)

    with server.http() as http:  # streamed: the error arrives as an OpenAI-shaped event, then [DONE]
        calls["n"] = 0
        body = {"model": server.model_name, "prompt": "boom", "max_tokens": 3, "stream": True}
        events = [line for line in http.post("/v1/completions", json=body).text.splitlines() if line]
        assert json.loads(events[0].removeprefix("data: "))["error"]["type"] == "server_error"
        assert events[-1] == "data: [DONE]"
        assert http.get("/health").status_code == 200
    out = client.completions.create(model=server.model_name, prompt="fine", max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    server.wait_until(lambda: server.all_blocks_free())


def test_metrics_parse_and_counters_move(server):
    before = server.scrape()
    for name in ("fxrewrite:num_requests_running", "fxrewrite:num_requests_waiting",
                 "fxrewrite:kv_cache_usage_perc", "fxrewrite:time_to_first_token_seconds_count",
                 "fxrewrite:inter_token_latency_seconds_count"):
        assert name in before
    server.client().completions.create(model=server.model_name, prompt="Count the tokens", max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    after = server.scrape()

    def moved(name):
        return after[f"fxrewrite:{name}"] - before[f"fxrewrite:{name}"]

    assert moved("generation_tokens_total") == 5
    assert moved("prompt_tokens_total") > 0
    assert moved("time_to_first_token_seconds_count") == 1
    assert 1 <= moved("inter_token_latency_seconds_count") <= 4  # 4 gaps, unless the first output held 2 tokens
    assert moved("e2e_request_latency_seconds_count") == 1
    key = "fxrewrite:request_success_total{finished_reason=length}"
    assert after[key] == before.get(key, 0) + 1


def test_metrics_and_health_need_no_key(server):
    assert httpx.get(f"{server.base_url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.base_url}/v1/models", timeout=10,
                     headers={"Authorization": f"Bearer {server.api_key}"}).status_code == 200


def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_blocks(server):
    before = server.scrape()
    body = {"model": server.model_name, "prompt": "Another long story:", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "n": 2}
    with server.http() as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    server.wait_until(lambda: server.all_blocks_free())
    after = server.scrape()
    # both completions, in the unit of request_success (each of n)
    assert after["fxrewrite:request_aborted_total"] == before["fxrewrite:request_aborted_total"] + 2


def test_a_choice_finished_before_the_client_leaves_counts_as_success_the_other_as_aborted(server):
    """n=2 streamed, one choice ends on a stop string while the other runs, then the client closes: one success and
    one abort (both were counted aborted: a fresh user's finding). Seeds are tried until a stream shows that state."""
    for seed in range(40):
        before = server.scrape()
        body = {"model": server.model_name, "prompt": "Story:", "max_tokens": 400, "temperature": 1.0, "seed": seed,
                "n": 2, "stop": ["e", "a"], "ignore_eos": True, "stream": True}
        finished: set[int] = set()
        with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    break  # [DONE]: both ended in one step; next seed
                finished |= {c["index"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]}
                if len(finished) == 1:
                    break  # leaving the `with` closes the connection while the other choice runs
        if len(finished) != 1:
            continue
        server.wait_until(lambda: server.all_blocks_free())
        after = server.scrape()
        assert after["fxrewrite:request_aborted_total"] == before["fxrewrite:request_aborted_total"] + 1
        success = sum(v for k, v in after.items() if k.startswith("fxrewrite:request_success_total"))
        assert success == sum(v for k, v in before.items() if k.startswith("fxrewrite:request_success_total")) + 1
        return
    pytest.fail("no seed gave a stream with one choice finished before the other")


def test_inter_token_latency_is_a_step_per_token_of_each_choice_with_n(monkeypatch):
    """n=4 choices gain a token each per 0.1 s step: each of the 4 tokens is a 0.1 s gap, not 0.025 (the step's time
    was split over every choice's tokens: a fresh user's finding); a reader that sees two steps at once counts 0.1 per
    token too."""
    from fxrewrite.runtime.server import async_engine
    from fxrewrite.runtime.server.metrics import ServerMetrics
    from fxrewrite.runtime.server.step_outputs import ChoiceSnapshot, StepOutput

    clock = {"now": 10.0}
    monkeypatch.setattr(async_engine.time, "monotonic", lambda: clock["now"])
    metrics = ServerMetrics("m")
    timer = async_engine._LatencyTimer(metrics, arrival=10.0)
    for step, tokens in ((1, 1), (2, 2), (4, 4)):  # outputs after steps 1, 2 and 4 (3 and 4 read at once)
        clock["now"] = 10.0 + 0.1 * step
        choices = tuple(ChoiceSnapshot(i, "", [7] * tokens, None, None, None) for i in range(4))
        timer.observe(StepOutput("r", 3, choices, finished=step == 4))
    gaps = metrics.registry.get_sample_value
    assert gaps("fxrewrite:inter_token_latency_seconds_count", {"model_name": "m"}) == 12  # 3 gaps x 4 choices
    assert gaps("fxrewrite:inter_token_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(1.2)
    # each choice is one of vLLM's child requests: a TTFT and an e2e latency each (there were one of each)
    assert gaps("fxrewrite:time_to_first_token_seconds_count", {"model_name": "m"}) == 4
    assert gaps("fxrewrite:time_to_first_token_seconds_sum", {"model_name": "m"}) == pytest.approx(0.4)
    assert gaps("fxrewrite:e2e_request_latency_seconds_count", {"model_name": "m"}) == 4


def test_each_choice_has_its_own_e2e_latency_and_a_late_first_token_its_own_ttft(monkeypatch):
    """n=2: choice 1's first token comes a step after choice 0's (its TTFT is its own), choice 0 ends at 0.2 s on a
    stop and choice 1 at 0.3 s: two e2e latencies, 0.2 and 0.3 s, and no choice's tokens are counted twice."""
    from fxrewrite.runtime.server import async_engine
    from fxrewrite.runtime.server.metrics import ServerMetrics
    from fxrewrite.runtime.server.step_outputs import ChoiceSnapshot, StepOutput

    clock = {"now": 10.0}
    monkeypatch.setattr(async_engine.time, "monotonic", lambda: clock["now"])
    metrics = ServerMetrics("m")
    timer = async_engine._LatencyTimer(metrics, arrival=10.0)
    for step, (a, b, reason) in enumerate(((1, 0, None), (2, 1, "stop"), (2, 2, None)), start=1):
        clock["now"] = 10.0 + 0.1 * step
        choices = (ChoiceSnapshot(0, "", [7] * a, None, reason, None), ChoiceSnapshot(1, "", [7] * b, None, None, None))
        timer.observe(StepOutput("r", 3, choices, finished=step == 3))
    value = metrics.registry.get_sample_value
    assert value("fxrewrite:time_to_first_token_seconds_sum", {"model_name": "m"}) == pytest.approx(0.1 + 0.2)
    assert value("fxrewrite:inter_token_latency_seconds_count", {"model_name": "m"}) == 2  # one gap per choice
    assert value("fxrewrite:e2e_request_latency_seconds_count", {"model_name": "m"}) == 2
    assert value("fxrewrite:e2e_request_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(0.2 + 0.3)
