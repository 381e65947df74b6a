"""A real uvicorn server on 127.0.0.1 (in a thread) over a real engine on a tiny Qwen3 folder."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
from tests.ports import free_port

API_KEY = "token-abc123"
MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 30


@dataclass
class ServerHandle:
    """The running test server: its URL, engine and app, the names tests need, and helpers."""

    base_url: str
    engine: object
    app: object
    model_name: str = MODEL_NAME
    max_model_len: int = MAX_MODEL_LEN
    api_key: str = API_KEY

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60, **kwargs)

    def async_client(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"})

    def scrape(self) -> dict[str, float]:
        """/metrics as {sample name (+ sorted labels except model_name): value}, via prometheus' parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return samples

    def all_blocks_free(self) -> bool:
        m = self.scrape()
        return (m["fxrewrite:num_free_blocks"] == m["fxrewrite:num_blocks"]
                and m["fxrewrite:num_requests_running"] == 0 and m["fxrewrite:num_requests_waiting"] == 0)

    @staticmethod
    def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.05) -> None:
        """Poll `predicate` until it is true; AssertionError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(interval_s)
        raise AssertionError(f"condition not met within {timeout_s}s")


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The app built by `fxrewrite serve`'s own argument path, served by uvicorn in a thread."""
    # 4 MiB of KV cache: a few hundred 16-token blocks for the tiny model; native model, CPU.
    with cli_server(tiny_model_dir("qwen3"), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "4M",
                    "--max-num-seqs", "64", "--enable-auto-tool-choice") as (url, engine, app, _):
        yield ServerHandle(url, engine, app)


@pytest.fixture(scope="session")
def grammar_compiler(server):
    """Build xgrammar's tokenizer info for the 151,936-token vocabulary once, outside any request timeout."""
    import xgrammar  # noqa: F401 - the serve extra: missing is a setup fault, not a skip
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

    server.engine.compile_structured_outputs(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


@contextmanager
def cli_server(model_dir, *flags: str, log_level: str = "warning"):
    """(base URL, engine, app, uvicorn.Server) of a server started as `fxrewrite serve MODEL_DIR --api-key API_KEY
    --served-model-name MODEL_NAME --model-impl native *flags` starts it (defaults: --max-model-len 256, 2 MiB of KV
    cache, when flags do not set them), in a thread; stopped on exit."""
    import uvicorn

    from fxrewrite.cli import build_parser
    from fxrewrite.commands.serve import build_server_app, uvicorn_kwargs

    port = free_port()
    defaults = [d for flag, value in (("--max-model-len", "256"), ("--kv-cache-memory-bytes", "2M"))
                if flag not in flags for d in (flag, value)]
    args = build_parser().parse_args(["serve", str(model_dir), "--port", str(port), "--api-key", API_KEY,
                                      "--served-model-name", MODEL_NAME, "--model-impl", "native", *defaults, *flags])
    engine, app = build_server_app(args)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level,
                                       timeout_graceful_shutdown=5, **uvicorn_kwargs(args)))
    thread = threading.Thread(target=uv.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine, app, uv
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
