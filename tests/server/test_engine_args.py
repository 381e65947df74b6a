"""The shared engine flags: vLLM names and defaults, --hf-overrides JSON, removed RoPE flags."""

import argparse
import dataclasses
import re

import pytest

from fxrewrite.cli import build_parser
from fxrewrite.commands.engine_args import add_engine_arguments, engine_kwargs, human_readable_int
from fxrewrite.errors import UserInputError


def parse(argv):
    return build_parser().parse_args(argv)


def test_defaults_match_llm_signature():
    from fxrewrite.runtime.engine_config import EngineConfig

    kwargs = engine_kwargs(parse(["serve"]))
    assert kwargs["model"] is None
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for name, value in kwargs.items():
        assert defaults[name] == value, name
    EngineConfig.from_kwargs(**kwargs)  # every key is an LLM(...) argument


def test_all_flags_reach_kwargs():
    args = parse([
        "serve", "some/model", "--model-impl", "transformers", "--hf-overrides",
        '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}', "--max-model-len", "32k",
        "--dtype", "bfloat16", "--seed", "7", "--max-num-seqs", "8", "--max-num-batched-tokens", "4K",
        "--block-size", "32", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
        "--kv-cache-memory-bytes", "1G", "--enforce-eager", "--tensor-parallel-size", "1",
        "--data-parallel-size", "2", "--enable-expert-parallel", "--tokenizer", "tok", "--load-format", "dummy", "--no-fusion", "--generation-config", "vllm", "--batch-invariant",
        "--port", "1234", "--api-key", "k", "--served-model-name", "a", "b", "--revision", "v1.0",
    ])
    kw = engine_kwargs(args)
    assert kw["model"] == "some/model" and kw["revision"] == "v1.0"
    assert kw["model_impl"] == "transformers"
    assert kw["hf_overrides"] == {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    assert kw["max_model_len"] == 32000 and kw["max_num_batched_tokens"] == 4096
    assert kw["kv_cache_memory_bytes"] == 2**30
    assert kw["data_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    assert (kw["dtype"], kw["seed"], kw["max_num_seqs"], kw["block_size"]) == ("bfloat16", 7, 8, 32)
    assert kw["enable_prefix_caching"] is False and kw["enforce_eager"] is True and kw["fusion"] is False
    assert kw["gpu_memory_utilization"] == 0.5 and kw["tokenizer"] == "tok" and kw["load_format"] == "dummy"
    assert kw["batch_invariant"] is True
    assert (args.port, args.api_key, args.served_model_name, args.generation_config) == (1234, "k", ["a", "b"], "vllm")


@pytest.mark.parametrize(
    "value, expected",
    [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"), ('"yarn"', "JSON str")],
)
def test_hf_overrides_errors_are_clear(value, expected, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--hf-overrides", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--hf-overrides" in err and expected in err


@pytest.mark.parametrize("flag", ["--rope-scaling", "--rope-theta"])
def test_removed_rope_flags_point_to_hf_overrides(flag, capsys):
    from fxrewrite.cli import main

    assert main(["generate", "--prompt", "hi", flag, '{"type": "yarn"}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "--hf-overrides" in err and "rope_parameters" in err, err


def test_model_is_optional_and_generate_chat_take_it():
    assert parse(["serve"]).model is None
    assert parse(["generate", "m", "--prompt", "hi", "--prompt", "yo"]).prompt == ["hi", "yo"]
    assert parse(["chat", "m", "--temperature", "0"]).model == "m"


@pytest.mark.parametrize("bad", ["--gpu-memory-utilization=1.5", "--max-model-len=0", "--block-size=x",
                                 "--data-parallel-size=0"])
def test_bad_values_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        parse(["serve", bad])
    assert e.value.code == 2


def test_human_readable_int():
    assert human_readable_int("2048") == 2048
    assert human_readable_int("1.5k") == 1500
    assert human_readable_int("2M") == 2 * 2**20
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")


def test_engine_arguments_on_a_fresh_parser():
    parser = add_engine_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).model_impl == "auto"


def test_removed_rope_flags_suggest_one_override_that_sets_them_all():
    """fresh-user report: with both flags the suggestion dropped --rope-theta, and a scaling without a type was
    suggested as is (which --hf-overrides then refuses for its missing rope_type)."""

    def message(*flags):
        with pytest.raises(UserInputError) as e:
            engine_kwargs(parse(["serve", *flags]))
        return str(e.value)

    assert """'{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}'""" in message(
        "--rope-scaling", '{"type": "yarn", "factor": 4.0}')
    both = message("--rope-scaling", '{"rope_type": "linear", "factor": 2}', "--rope-theta", "5000")
    assert both.startswith("--rope-scaling and --rope-theta were removed")
    assert """'{"rope_parameters": {"rope_type": "linear", "factor": 2, "rope_theta": 5000.0}}'""" in both, both
    assert "and a rope_type (--rope-scaling named none" in message("--rope-scaling", '{"factor": 2}')
    assert "e.g. --hf-overrides" in message("--rope-scaling", "not json")
    kept = message("--rope-theta", "5", "--hf-overrides", '{"max_model_len": 100, "rope_parameters": {"factor": 2}}')
    assert """'{"max_model_len": 100, "rope_parameters": {"factor": 2, "rope_theta": 5.0}}'""" in kept, kept


def test_hf_overrides_given_twice_is_an_error_not_the_last_one_kept(capsys):
    """fresh-user report: a second --hf-overrides silently dropped the first (its max_model_len)."""
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--hf-overrides", '{"max_model_len": 4}', "--hf-overrides", '{"rope_parameters": {}}'])
    assert e.value.code == 2 and "--hf-overrides was given twice" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"], ["chat"],
                                     ["bench", "compare", "--config", "tiny"]])
@pytest.mark.parametrize("spelling, level", [(["-O", "3"], 3), (["-O3"], 3), (["--compilation-config", "2"], 2),
                                             ([], 0)])
def test_optimization_level_flag_on_every_engine_command(command, spelling, level):
    """fresh-8 F22: -O existed on `bench compare` only; it reaches LLM(compilation_config=...)."""
    args = parse(command + spelling)
    assert args.compilation_config == level
    if command[0] != "bench":
        from fxrewrite.runtime.engine_config import EngineConfig

        assert EngineConfig.from_kwargs(**engine_kwargs(args)).compilation_config == level


@pytest.mark.parametrize("bad", ["5", "x", "-1", '{"level": 3}'])
def test_bad_optimization_level_is_a_clear_cli_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["serve", "-O", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--compilation-config/-O" in err and "expected an optimisation level 0, 1, 2 or 3" in err and repr(bad) in err


def test_bad_compilation_config_in_python_is_a_user_input_error():
    from fxrewrite.runtime.engine_config import EngineConfig

    for bad in (5, "3", True, {"level": 3}):
        with pytest.raises(UserInputError, match=r"compilation_config=.*expected an optimisation level"):
            EngineConfig(compilation_config=bad)


def test_engine_refusals_name_the_request_field():
    """An engine refusal names the SamplingParams field; the server names the request field that set it (a forced
    tool call's constraint is tool_choice's, chat's logprobs count is top_logprobs)."""
    from fxrewrite.runtime.server.serving_engine import _refused_field

    unsupported = "structured_outputs is not supported with (a hypothetical refusal)"
    sent_as = {"logprobs": "top_logprobs", "structured_outputs": "tool_choice"}
    assert _refused_field(unsupported, sent_as) == (
        "tool_choice is not supported with (a hypothetical refusal)", "tool_choice")
    assert _refused_field("logprobs=21 is more than max_logprobs=20", sent_as) == (
        "top_logprobs=21 is more than max_logprobs=20", "top_logprobs")
    assert _refused_field("prompt_logprobs=3 is more than max_logprobs=2", sent_as)[1] == "prompt_logprobs"
    assert _refused_field("bad_words is not supported with tensor ...", {})[1] == "bad_words"
    echo = {"prompt_logprobs": ("echo", "echo with logprobs")}  # a completion's echo + logprobs sets prompt_logprobs
    assert _refused_field("prompt_logprobs is not supported with tensor ...", echo) == (
        "echo with logprobs is not supported with tensor ...", "echo")
    assert _refused_field("the prompt is too long", sent_as) == ("the prompt is too long", None)
    too_big = "prompt token id 108386 (the tokenizer's) is out of range [0, 49152): ..."  # chat's prompt: messages
    assert _refused_field(too_big, {"prompt": ("messages", "prompt")}) == (too_big, "messages")


def test_api_key_falls_back_to_vllm_api_key(monkeypatch):
    """vLLM reads VLLM_API_KEY when --api-key is not given; a deployment moved over keeps its key (a fresh user found
    the server open). The flag wins; neither: no key."""
    from fxrewrite.commands.serve import api_key

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key(parse(["serve", "m"])) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_key(parse(["serve", "m"])) == "from-env"
    assert api_key(parse(["serve", "m", "--api-key", "flag"])) == "flag"


@pytest.mark.parametrize("flags, message", [(["--api-key", ""], "--api-key '' is empty"),
                                            (["--api-key", " "], "--api-key ' ' is empty"),
                                            (["--served-model-name", "a", ""], "--served-model-name '' is empty"),
                                            (["--served-model-name", "a", "b", "a"],
                                             "--served-model-name names 'a' twice"),
                                            (["--enable-log-requests", "--disable-log-requests"], "contradict")])
def test_an_empty_key_or_served_name_is_refused_before_the_model_loads(flags, message, monkeypatch):
    """`--api-key "$KEY"` with KEY unset served with no key at all, and `--served-model-name ''` a model named ""
    (fresh user); vLLM's older `--disable-log-requests` is taken, but not with `--enable-log-requests`."""
    from fxrewrite.commands import serve

    monkeypatch.setattr("fxrewrite.runtime.engine.data_parallel.make_engine", pytest.fail)
    with pytest.raises(UserInputError, match=re.escape(message)):
        serve.build_server_app(parse(["serve", "m", *flags]))


def test_trust_remote_code_flag_reaches_the_engine():
    assert engine_kwargs(parse(["serve", "m"]))["trust_remote_code"] is False
    assert engine_kwargs(parse(["serve", "m", "--trust-remote-code"]))["trust_remote_code"] is True


def test_vllm_flags_without_settings_reach_the_engines_check():
    """A vLLM command line runs unchanged: `--disable-log-stats --enable-chunked-prefill ...` are passed on only when
    given, accepted where they match this engine, and a value it does not honour is the engine's one-line error."""
    from fxrewrite.runtime.engine_config import EngineConfig

    assert not {"disable_log_stats", "swap_space"} & set(engine_kwargs(parse(["serve"])))
    kw = engine_kwargs(parse(["serve", "--enable-sleep-mode", "--disable-log-stats", "--enable-chunked-prefill",
                              "--swap-space", "4", "--tokenizer-mode", "hf", "--distributed-executor-backend", "uni",
                              "--logprobs-mode", "raw_logprobs"]))
    assert kw["disable_log_stats"] is True and kw["swap_space"] == 4.0 and kw["tokenizer_mode"] == "hf"
    EngineConfig.from_kwargs(**kw)
    for flags, message in ((["--no-enable-chunked-prefill"], "enable_chunked_prefill=False is not supported"),
                           (["--tokenizer-mode", "mistral"], "tokenizer_mode='mistral' is not supported"),
                           (["--distributed-executor-backend", "ray"], "'ray' is not supported")):
        with pytest.raises(UserInputError, match=message):
            EngineConfig.from_kwargs(**engine_kwargs(parse(["serve", *flags])))
