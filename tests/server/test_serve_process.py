"""`fxrewrite serve` as its own process on 127.0.0.1 (issue 5: "a real server process"): the command's
`run()` and uvicorn's own loop, which the in-process `server` fixture does not go through."""

import subprocess
import sys
import time

import httpx
import pytest
from tests.ports import free_port

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 120


def test_serve_command_answers_the_openai_client_then_stops_on_sigterm(tiny_qwen3_dir):
    from openai import OpenAI

    port = free_port()
    argv = [sys.executable, "-m", "fxrewrite", "serve", str(tiny_qwen3_dir), "--port", str(port),
            "--model-impl", "native", "--max-model-len", "256", "--kv-cache-memory-bytes", "2M",
            "--served-model-name", "tiny", "--uvicorn-log-level", "warning", "--enable-auto-tool-choice",
            "--enable-log-requests", "--max-log-len", "12"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
        # lm-eval's loglikelihood shape, a forced tool call and a guided choice, all in this process
        out = client.completions.create(model="tiny", prompt=[[785, 6722, 315, 9625, 374]], max_tokens=1,
                                        logprobs=1, echo=True, temperature=0)
        assert out.choices[0].logprobs.token_logprobs[0] is None and len(out.choices[0].logprobs.tokens) == 6
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}}}]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
        assert chat.choices[0].message.tool_calls[0].function.name == "f"
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"guided_choice": ["yes", "no"]})
        assert chat.choices[0].message.content in ("yes", "no")
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: a normal exit, the engine's exit handlers run
    assert proc.returncode == 0, output
    assert "leaked" not in output, output
    assert "Traceback" not in output, output
    assert f"on http://127.0.0.1:{port}/v1" in output
    assert "Received request" in output and "'The capital '" in output  # --max-log-len 12
