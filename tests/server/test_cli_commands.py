"""`fxrewrite generate` and `fxrewrite chat` print what the server answers for the same greedy requests.

The commands run in-process through `fxrewrite.cli.main`, over the session's real engine (the one
the test server uses, idle meanwhile) so that no second model load is paid.
"""

import io
import subprocess
import sys

import pytest

from fxrewrite.cli import main

PROMPT = "The capital of France is"


@pytest.fixture
def shared_engine(server, monkeypatch):
    """`LLM(...)` inside the commands gets the server's engine instead of loading the model again."""
    import fxrewrite.runtime.llm as llm_module

    monkeypatch.setattr(llm_module, "make_engine", lambda config: server.engine)
    return server.engine


def _argv(command, model_dir, *extra):
    return [command, str(model_dir), "--model-impl", "native", "--temperature", "0", "--max-tokens", "6", *extra]


def test_generate_prints_the_completion(server, shared_engine, tiny_qwen3_dir, capsys):
    assert main(_argv("generate", tiny_qwen3_dir, "--prompt", PROMPT)) == 0
    printed = capsys.readouterr().out
    expected = server.client().completions.create(model=server.model_name, prompt=PROMPT, temperature=0, max_tokens=6)
    assert printed == expected.choices[0].text + "\n"


def test_generate_chat_template_is_a_file_or_the_text(server, shared_engine, tiny_qwen3_dir, capsys, tmp_path):
    """A template that writes the user's text alone gives the plain completion; `--chat` uses the model's own
    template, as the server's chat completions do."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "plain.jinja").write_text(template)
    outputs = []
    for flags in ([], ["--chat-template", template], ["--chat-template", str(tmp_path / "plain.jinja")], ["--chat"]):
        assert main(_argv("generate", tiny_qwen3_dir, "--prompt", PROMPT, *flags)) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]
    expected = server.client().chat.completions.create(model=server.model_name, temperature=0, max_tokens=6,
                                                       messages=[{"role": "user", "content": PROMPT}])
    assert outputs[3] == expected.choices[0].message.content + "\n"


@pytest.mark.parametrize("ending", ["exit\nnever read\n", ""])  # "exit", or EOF
def test_chat_answers_each_line_and_quits(server, shared_engine, tiny_qwen3_dir, capsys, monkeypatch, ending):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hello.\n\nAnd again.\n" + ending))
    assert main(_argv("chat", tiny_qwen3_dir)) == 0
    printed = capsys.readouterr().out
    client = server.client()
    messages = [{"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=server.model_name, messages=messages, temperature=0, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And again."}]
    second = client.chat.completions.create(model=server.model_name, messages=messages, temperature=0, max_tokens=6)
    assert printed == first.choices[0].message.content + "\n" + second.choices[0].message.content + "\n"


def test_bad_hf_overrides_is_one_clean_line():
    out = subprocess.run([sys.executable, "-m", "fxrewrite", "serve", "--hf-overrides", "{oops"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--hf-overrides" in out.stderr and "not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_on_a_busy_port_fails_before_the_model_loads(monkeypatch, capsys):
    import socket

    import fxrewrite.runtime.engine.data_parallel as data_parallel

    def load_model(config):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(data_parallel, "make_engine", load_model)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in err and "--port" in err
    assert main(["serve", "--host", "no-such-host.invalid", "--port", str(port)]) == 2
    assert "--host 'no-such-host.invalid': cannot resolve it" in capsys.readouterr().err


def test_serve_port_zero_listens_on_the_port_it_prints(monkeypatch, capsys, tiny_qwen3_dir):
    """--port 0 binds a free port before the model loads (as vLLM's early bind); the printed URL names it and
    uvicorn serves the app on that socket. (`run_server` itself sets a SIGTERM handler, so the test serves the
    socket from a thread with its own uvicorn.Server.)"""
    import threading

    import httpx
    import uvicorn

    import fxrewrite.runtime.server.api_server as api_server

    served = {}

    def run_server(app, sock, log_level="info", **uvicorn_kwargs):
        served["port"] = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_kwargs))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        for _ in range(400):
            try:
                served["health"] = httpx.get(f"http://127.0.0.1:{served['port']}/health", timeout=1).status_code
                break
            except httpx.TransportError:
                threading.Event().wait(0.05)
        server.should_exit = True
        thread.join(timeout=30)

    monkeypatch.setattr(api_server, "run_server", run_server)
    assert main(["serve", str(tiny_qwen3_dir), "--port", "0", "--max-num-seqs", "2"]) == 0
    assert served["port"] > 0 and served["health"] == 200
    assert f"on http://127.0.0.1:{served['port']}/v1" in capsys.readouterr().out
    assert main(["serve", "--port", "-1"]) == 2
    assert "--port -1 is not a TCP port (1..65535, or 0 for a free one)" in capsys.readouterr().err
