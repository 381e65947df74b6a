"""The CLI prints bad user input as one line, and keeps the traceback of everything else (issue 15 item 13)."""

import pytest

import fxrewrite.commands.generate as generate_command
from fxrewrite.cli import main
from fxrewrite.errors import UserFileNotFoundError, UserInputError, UserTypeError


def test_user_input_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["generate", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxrewrite generate: error: ") and str(missing) in err
    assert err.count("\n") == 1 and "Traceback" not in err


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
