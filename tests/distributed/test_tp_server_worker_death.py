"""`fxrewrite serve -tp 2` (gloo, 2 CPU ranks) when a worker process dies (new-user review F8): the requests in
flight, every later request and /health answer 503 in OpenAI's error shape (`code: "engine_dead"`, the
message naming the worker's exit), a stream ends with that error event; the KV blocks are freed and the
other worker is stopped. Before, they were 500s ("internal error: WorkerError: ...", logged with a
traceback by uvicorn) and a worker dying between requests left /health at 200."""

import contextlib
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("qwen3", num_key_value_heads=1, vocab="smollm2"))  # small vocabulary: fast start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _tp2_server(model_dir: str):
    """(base URL, engine) of a `serve -tp 2` app served by uvicorn in a thread."""
    import uvicorn

    from fxrewrite.cli import build_parser
    from fxrewrite.commands.serve import build_server_app

    port = _free_port()
    args = build_parser().parse_args(["serve", model_dir, "--port", str(port), "--model-impl", "native", "-tp", "2",
                                      "--max-model-len", "2048", "--kv-cache-memory-bytes", "1M", "--dtype", "float32"])
    engine, app = build_server_app(args)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(15)
        engine.model_runner.shutdown()


def _assert_engine_dead(response: httpx.Response) -> str:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_dead"
    assert error["message"].startswith("the engine is dead: ") and "process 1 terminated with signal SIGKILL" in error["message"]
    return error["message"]


def _assert_workers_gone(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_worker_death_fails_requests_in_flight_and_later_ones_with_503(model_dir):
    with _tp2_server(model_dir) as (url, engine), httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
        pids = engine.model_runner.worker_pids()
        answers = {}
        blocking = threading.Thread(target=lambda: answers.update(plain=httpx.post(
            f"{url}/v1/completions", json=LONG, timeout=60)))
        blocking.start()
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")) and stream.status_code == 200
            os.kill(pids[1], signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        blocking.join(60)
        assert '"code": "engine_dead"' in events[-2] and "SIGKILL" in events[-2] and events[-1] == "data: [DONE]"
        message = _assert_engine_dead(answers["plain"])  # the request in flight: not a 500, not a hang
        assert _assert_engine_dead(http.post("/v1/completions", json=LONG)) == message
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert _assert_engine_dead(http.post("/v1/chat/completions", json=chat)) == message
        assert _assert_engine_dead(http.get("/health")) == message
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        _assert_workers_gone(pids)


def test_worker_death_between_requests_turns_health_503(model_dir):
    with _tp2_server(model_dir) as (url, engine), httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
        assert http.get("/health").status_code == 200
        pids = engine.model_runner.worker_pids()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (health := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 after a worker died"
            time.sleep(0.05)
        message = _assert_engine_dead(health).removeprefix("the engine is dead: ")
        assert message.startswith("tensor-parallel worker failed during the wait between steps")
        assert message in _assert_engine_dead(http.post("/v1/completions", json=LONG))
        assert message in _assert_engine_dead(http.get("/health"))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        _assert_workers_gone(pids)
