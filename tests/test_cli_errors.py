"""The CLI prints bad user input as one line, and keeps the traceback of everything else (issue 15 item 13)."""

import socket

import pytest

import fxrewrite.commands.generate as generate_command
from fxrewrite.cli import main
from fxrewrite.errors import UserFileNotFoundError, UserInputError, UserTypeError
from tests.ports import free_port


def test_user_input_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["generate", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxrewrite generate: error: ") and str(missing) in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--runner", "pooling"], ["chat", "--task", "embed"]])
def test_text_commands_refuse_the_pooling_runner_before_loading(argv, capsys, monkeypatch):
    import fxrewrite.runtime.llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", lambda **kw: pytest.fail("the model was loaded"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "fxrewrite serve MODEL --runner pooling" in err and err.count("\n") == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-tokens", "-3"], "argument --max-tokens: expected a positive integer, got '-3'"),
    (["--temperature", "-1"], "SamplingParams: temperature=-1.0 must be in [0, "),
    (["--top-p", "0"], "SamplingParams: top_p=0.0 must be in (0, 1]"),
])
def test_a_bad_sampling_flag_is_one_line_before_the_model_loads(flags, message, capsys, monkeypatch):
    """Named by the flag (argparse, after its usage lines) or by SamplingParams' field, in the error's one line, before
    any model is loaded (fresh-user finding: `--max-tokens -3` loaded the model first and did not name the flag)."""
    import fxrewrite.runtime.llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", lambda **kw: pytest.fail("the model was loaded"))
    for command in ("generate", "chat"):
        argv = [command, *(["--prompt", "hi"] if command == "generate" else []), *flags]
        try:
            status = main(argv)
        except SystemExit as exit_info:  # argparse's own exit
            status = exit_info.code
        err = capsys.readouterr().err
        assert status == 2 and message in err.splitlines()[-1] and "Traceback" not in err, (command, err)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("broken", ["missing", "not-an-object"])
def test_a_bad_generation_config_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, command, broken):
    import fxrewrite.runtime.engine.data_parallel as data_parallel
    import fxrewrite.runtime.llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", lambda **kw: pytest.fail("the model was loaded"))
    monkeypatch.setattr(data_parallel, "make_engine", lambda *a, **kw: pytest.fail("the model was loaded"))
    folder = tmp_path / "gen"
    folder.mkdir()
    if broken == "not-an-object":
        (folder / "generation_config.json").write_text("[1, 2]")
    extra = {"generate": ["--prompt", "hi"], "serve": ["--port", str(free_port())]}.get(command, [])
    assert main([command, "--generation-config", str(folder), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fxrewrite {command}: error: ") and err.count("\n") == 1, err
    assert ("no generation_config.json" if broken == "missing" else "must hold a JSON object") in err


@pytest.mark.parametrize(("overrides", "message"), [
    ('{"head_dim": 7}', "rotary_dim = int(head_size * partial_rotary_factor) = 7 must be even"),
    ('{"hidden_act": "gelu"}', "the native LlamaForCausalLM does not compute this config as transformers does: "
                               "hidden_act='gelu'"),  # with --model-impl native; auto serves it with transformers
    ('{"vocab_size": 10}', "prompt token id"),
])
def test_overrides_the_model_cannot_run_are_one_line(tiny_llama_dir, overrides, message, capsys):
    """Config values a model cannot be built or run with, set through --hf-overrides (fresh user: tracebacks)."""
    argv = ["generate", str(tiny_llama_dir), "--prompt", "hi there", "--max-tokens", "1", "--hf-overrides", overrides,
            "--load-format", "dummy", "--model-impl", "native"]  # random weights of the new shape (real ones are refused for it, as they should)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_bad_bench_config_is_one_line(capsys):
    assert main(["bench", "compare", "--config", "no-such-config"]) == 2
    err = capsys.readouterr().err
    assert "no-such-config" in err and err.count("\n") == 1


@pytest.mark.parametrize("error", [ValueError("internal bug"), TypeError("unsupported operand"),
                                   FileNotFoundError("a file the package should ship")])
def test_other_errors_keep_their_traceback(monkeypatch, error):
    def run(args):
        raise error
    monkeypatch.setattr(generate_command, "run", run)
    with pytest.raises(type(error), match=str(error)):
        main(["generate", "--prompt", "hi"])


def test_user_errors_are_still_the_builtin_types():
    assert issubclass(UserInputError, ValueError)
    assert issubclass(UserTypeError, TypeError) and issubclass(UserTypeError, UserInputError)
    assert issubclass(UserFileNotFoundError, FileNotFoundError) and issubclass(UserFileNotFoundError, UserInputError)


def test_a_config_transformers_rejects_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_architecture"}')
    assert main(["explain", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_architecture" in err and "Traceback" not in err


def test_unknown_flag_after_a_subcommand_shows_that_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "MODEL", "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage: fxrewrite serve" in err
    assert "fxrewrite serve: error: unrecognized arguments: --bogus" in err


def test_version_prints_the_installed_package_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"fxrewrite {importlib.metadata.version('fxrewrite')}\n"


def test_generate_chat_template_takes_a_value_as_serve_does(tmp_path, capsys):
    """`--chat-template` is a file path or the template text (vLLM's serve flag); `--chat` uses the model's."""
    from fxrewrite.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--chat-template", "t.jinja"])
    assert args.chat_template == "t.jinja" and not args.chat
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--chat"]).chat
    assert main(["generate", "--prompt", "hi", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "missing.jinja: no such file" in err.replace("'", "")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_chat_template_jinja_cannot_parse_is_one_line_before_the_model_loads(tmp_path, capsys, command):
    # the model folder does not exist: the template is refused first, naming the flag and the line
    missing = str(tmp_path / "no-such-model")
    args = [command, missing, "--chat-template", "{% for m in messages %}{{ m['content'] "]
    if command == "serve":  # a free port, so the port check (which comes first) passes
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    assert main(args + (["--prompt", "hi"] if command == "generate" else ["--port", str(port)])) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "not a valid Jinja template" in err and "line 1" in err
    assert err.count("\n") == 1 and "Traceback" not in err and missing not in err
    template = tmp_path / "bad.jinja"
    template.write_text("{{ messages[0]['content'] }}\n{% if x %}")
    assert main(["generate", missing, "--prompt", "hi", "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert str(template) in err and "line 2" in err and err.count("\n") == 1


def test_a_valid_chat_template_file_loads_unchanged():
    from pathlib import Path

    from fxrewrite.commands.sampling_args import load_chat_template

    path = Path(__file__).resolve().parents[1] / "examples" / "tool_chat_template_hermes.jinja"
    assert load_chat_template(str(path)) == path.read_text()


def _copy_model(src, dst, skip=()):
    import shutil

    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip and f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.parametrize("damage, message", [
    ("no weights", r"no \*\.safetensors file in .*: expected the model's weights"),
    ("truncated weights", r"model\.safetensors is not a readable safetensors file"),
    ("bad config.json", r"config\.json is not valid JSON"),
    ("fake gguf", r"does not start with the GGUF magic bytes"),
    ("truncated gguf", r"truncated\.gguf' is not a readable GGUF file transformers supports: error: unpack_from"),
    ("no tokenizer", r"tokenizer '.*model' has no vocabulary \(1 token\(s\); .*\): pass a folder or hub id"),
    ("bad tokenizer.json", r"tokenizer '.*model' cannot be loaded: JSONDecodeError: "),
    ("partial tokenizer.json", r"tokenizer '.*model' cannot be loaded: \w+: "),
])
def test_a_broken_model_folder_or_file_is_one_line(tiny_qwen3_dir, tmp_path, capsys, damage, message):
    """fresh-9 F5: these printed a safetensors / transformers / gguf traceback; so did a GGUF file cut after its
    header and a corrupt tokenizer.json, and a folder without tokenizer files loaded an empty tokenizer (every prompt
    "empty")."""
    import re

    if damage in ("fake gguf", "truncated gguf"):
        model = tmp_path / ("fake.gguf" if damage == "fake gguf" else "truncated.gguf")
        model.write_bytes(b"not a gguf file at all" if damage == "fake gguf" else b"GGUF\x03\x00\x00\x00")
    elif damage in ("no tokenizer", "bad tokenizer.json", "partial tokenizer.json"):
        tokenizer_files = [f.name for f in tiny_qwen3_dir.iterdir() if f.name.startswith(("tokenizer", "vocab"))]
        skip = tokenizer_files if damage == "no tokenizer" else ()
        model = _copy_model(tiny_qwen3_dir, tmp_path / "model", skip=skip)
        if damage != "no tokenizer":  # JSON that is not a tokenizer: the tokenizers library's KeyError or Exception
            (model / "tokenizer.json").write_text("{bad" if damage == "bad tokenizer.json" else
                                                  '{"version": "1.0", "model": {"type": "BPE"}}')
    else:
        weights = [f.name for f in tiny_qwen3_dir.glob("*.safetensors")]
        model = _copy_model(tiny_qwen3_dir, tmp_path / "model", skip=weights if damage == "no weights" else ())
        if damage == "truncated weights":
            data = (model / weights[0]).read_bytes()
            (model / "model.safetensors").write_bytes(data[:5])
            for extra in set(weights) - {"model.safetensors"}:
                (model / extra).unlink()
        if damage == "bad config.json":
            (model / "config.json").write_text('{"model_type": ')
    assert main(["generate", str(model), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_chat_template_that_raises_is_one_line(tiny_qwen3_dir, capsys):
    assert main(["generate", str(tiny_qwen3_dir), "--prompt", "hi", "--max-tokens", "1",
                 "--chat-template", '{{ raise_exception("nope") }}']) == 2
    err = capsys.readouterr().err
    assert "chat template failed: nope" in err and err.count("\n") == 1, err


def test_chat_goes_on_after_a_message_the_context_cannot_hold(tiny_qwen3_dir, capsys, monkeypatch):
    """A turn that makes the conversation longer than max_model_len is reported and dropped; the chat goes on
    and the next message is answered with the conversation as it was."""
    import io

    long = " ".join(["word"] * 200)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hi\n{long}\nhello\n"))
    assert main(["chat", str(tiny_qwen3_dir), "--max-model-len", "96", "--max-tokens", "2", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("fxrewrite chat: error: ") == 1 and "max_model_len=96" in captured.err, captured.err
    assert "prompt 0" not in captured.err and "that message was not sent" in captured.err
    assert len(captured.out.splitlines()) == 2  # the first and the third message were answered


def test_model_impl_native_without_a_native_class_is_one_line(tiny_model_dir, capsys):
    """fresh-user report: a ValueError traceback from the model runner."""
    path = tiny_model_dir("gemma2")
    capsys.readouterr()  # the folder's build progress
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "1", "--model-impl", "native"]) == 2
    err = capsys.readouterr().err
    assert "no native implementation for ['Gemma2ForCausalLM']; native ones: [" in err and err.count("\n") == 1, err


def test_a_reader_that_closes_stdout_ends_the_command_quietly(tiny_qwen3_dir):
    """`fxrewrite generate ... | head -c 20`: a BrokenPipeError traceback (and exit 1 from the final flush) before."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "fxrewrite", "generate", str(tiny_qwen3_dir), "--prompt", "hi",
                             "--max-tokens", "16", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before the text is written (the model is still loading)
    _, err = proc.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]
    assert proc.returncode == 1


@pytest.mark.parametrize("content, message", [
    ("[1]", "must hold a JSON object, got list"), ("not json", "is not valid JSON text"),
    ('{"eos_token_id": "abc"}', "eos_token_id='abc'; expected a token id or a list of token ids"),
])
def test_a_model_folders_broken_generation_config_is_one_line(tiny_qwen3_dir, tmp_path, capsys, content, message):
    """The model's own generation_config.json is read for its EOS ids: a broken one was an AttributeError, a
    JSONDecodeError or a TypeError traceback (the engine's EOS list), also under --generation-config vllm."""
    import shutil

    folder = shutil.copytree(tiny_qwen3_dir, tmp_path / "model")
    (folder / "generation_config.json").write_text(content)
    assert main(["generate", str(folder), "--prompt", "hi", "--max-tokens", "1", "--generation-config", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxrewrite generate: error: ") and err.count("\n") == 1, err
    assert f"{folder / 'generation_config.json'}" in err and message in err, err


@pytest.mark.parametrize("argv,flag", [(["generate", "--model-i", "native", "--prompt", "hi"], "--model-i"),
                                       (["bench", "compare", "--conf", "tiny"], "--config")])
def test_abbreviated_flags_are_not_taken_for_longer_ones(argv, flag, capsys):
    """`--model X` was read as `--model-impl X` (argparse's abbreviations), an error naming a flag not typed."""
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert flag in err and "--model-impl" not in err.splitlines()[-1], err


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "explain"])
def test_model_is_positional_or_vllms_model_flag(command, monkeypatch, tmp_path, capsys):
    """`--model MODEL` is the positional MODEL (vLLM's serve still takes it); the two naming different models is an
    error naming both."""
    seen = []
    monkeypatch.setattr(f"fxrewrite.commands.{command}.run", lambda args: seen.append(args.model) or 0)
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, "--model", "some/model", *extra]) == 0
    assert main([command, "some/model", "--model=some/model", *extra]) == 0
    assert main([command, *extra]) == 0
    assert main([command, str(tmp_path), "--model", f"{tmp_path}/", *extra]) == 0  # one folder, two spellings
    assert seen == ["some/model", "some/model", None, str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main([command, "one/model", "--model", "other/model", *extra])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([command, "--model", "one/model", "--model", "other/model", *extra])  # not silently the last
    assert e.value.code == 2 and "--model was given twice; give one" in capsys.readouterr().err
