"""vLLM's LLM(...) behaviour this engine follows: `generation_config` (defaults from the model's
generation_config.json for generate / chat without sampling_params, `get_default_sampling_params`), and the
vLLM arguments accepted with the values that match this engine (`VLLM_COMPAT_KWARGS`), the others refused."""

import json
import logging
import re
import shutil

import numpy as np
import pytest

from fxrewrite import LLM, SamplingParams
from fxrewrite.runtime.engine_config import EngineConfig

SMALL = {"kv_cache_memory_bytes": 1 << 22, "max_model_len": 256}
DEFAULTS = {"max_new_tokens": 5, "top_k": 1, "do_sample": True}  # do_sample: a key vLLM does not take over


@pytest.fixture(scope="module")
def model_with_defaults(tiny_qwen3_dir, tmp_path_factory):
    """The tiny Qwen3 with max_new_tokens and top_k in its generation_config.json (a copy: the shared folder
    stays as the other tests know it)."""
    folder = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(tiny_qwen3_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def llm(model_with_defaults):
    return LLM(str(model_with_defaults), **SMALL)


def test_default_sampling_params_come_from_generation_config(llm):
    params = llm.get_default_sampling_params()
    assert (params.max_tokens, params.top_k) == (5, 1)
    assert (params.temperature, params.top_p) == (1.0, 1.0)  # not in the file: SamplingParams' own
    assert llm.get_default_sampling_params() is not params  # a new one each call: changing it changes no other


def test_generate_and_chat_without_params_use_the_defaults(llm):
    greedy = SamplingParams(max_tokens=5, temperature=0)  # top_k=1 samples the argmax
    defaulted = [o.outputs[0] for o in llm.generate(["Hello there", "A"], use_tqdm=False)]
    assert [o.token_ids for o in defaulted] == \
        [o.outputs[0].token_ids for o in llm.generate(["Hello there", "A"], greedy, use_tqdm=False)]
    assert [(len(o.token_ids), o.finish_reason) for o in defaulted] == [(5, "length")] * 2
    conversation = [{"role": "user", "content": "Name a colour."}]
    out = llm.chat(conversation, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # greedy decoding of this conversation does not stop within 8 tokens, so the 5 below is max_tokens at work
    # (the file's max_new_tokens), not an early stop hiding a wrong default
    longer = llm.chat(conversation, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    assert (len(longer.token_ids), longer.finish_reason) == (8, "length")
    assert list(longer.token_ids[:5]) == list(out.token_ids)
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_explicit_params_are_not_changed(llm):
    params = SamplingParams(max_tokens=9, ignore_eos=True, seed=1)
    out = llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 9  # not the file's max_new_tokens=5
    assert (params.max_tokens, params.top_k) == (9, 0)
    several = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True)]
    assert [len(o.outputs[0].token_ids) for o in llm.generate(["a", "b"], several, use_tqdm=False)] == [2, 7]


def test_vllm_ignores_the_file_and_a_folder_supplies_another(model_with_defaults, tiny_qwen3_dir, tmp_path):
    plain = LLM(str(model_with_defaults), generation_config="vllm", **SMALL)
    assert plain.get_default_sampling_params() == SamplingParams()
    out = plain.generate("Hello there", use_tqdm=False)[0].outputs[0]
    # SamplingParams' max_tokens (16), not the file's 5; the random tiny model (a Qwen vocabulary of 151k tokens,
    # the engine's shared generator seeded with 0) samples no end-of-sequence token in 16 steps
    assert (len(out.token_ids), out.finish_reason) == (16, "length")
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.5}))
    other = LLM(str(tiny_qwen3_dir), generation_config=tmp_path, **SMALL)  # a path-like folder
    params = other.get_default_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k) == (3, 0.5, 0)


def test_a_model_without_sampling_defaults_keeps_sampling_params_defaults(tiny_qwen3_dir):
    # the demo model's generation_config.json holds only token ids, so `make run` is unchanged
    assert LLM(str(tiny_qwen3_dir), **SMALL).get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("bad, error, match", [
    (5, TypeError, r"generation_config=5 must be 'auto'.*'vllm'.*folder"),
    ("", TypeError, r"generation_config='' must be"),
    ("/no/such/folder", FileNotFoundError, r"generation_config='/no/such/folder'.*no generation_config.json"
                                           r".*expected 'auto', 'vllm' or a folder"),
])
def test_a_bad_generation_config_is_refused_before_the_model_loads(bad, error, match, monkeypatch):
    import fxrewrite.runtime.llm as llm_module

    monkeypatch.setattr(llm_module, "make_engine", lambda config: pytest.fail("the model loaded"))
    with pytest.raises(error, match=match):
        LLM("unused", generation_config=bad)


def test_a_generation_config_sampling_params_refuses_names_the_file(tiny_qwen3_dir, tmp_path, monkeypatch):
    import fxrewrite.runtime.llm as llm_module

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    monkeypatch.setattr(llm_module, "make_engine", lambda config: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=r"generation_config.json: .*temperature"):
        LLM(str(tiny_qwen3_dir), generation_config=str(tmp_path), **SMALL)


def test_a_broken_model_file_fails_only_calls_without_params(tiny_qwen3_dir, tmp_path):
    # read on first use, as vLLM does: the CLI passes its own SamplingParams (`--generation-config vllm`)
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"top_k": "one"}))
    llm = LLM(str(folder), **SMALL)
    assert len(llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"generation_config.json: .*top_k"):
        llm.generate("Hi", use_tqdm=False)


def test_llm_takes_the_vllm_arguments_rl_code_passes(model_with_defaults):
    llm = LLM(str(model_with_defaults), enable_sleep_mode=True, disable_log_stats=True, enable_chunked_prefill=True,
              swap_space=4, tokenizer_mode="auto", task="generate", distributed_executor_backend="uni",
              logprobs_mode="raw_logprobs", **SMALL)
    assert llm.llm_engine.config.runner == "generate"
    llm.sleep()  # as with vLLM's enable_sleep_mode=True
    llm.wake_up()
    assert len(llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2


@pytest.mark.parametrize("name, value", [
    ("enable_sleep_mode", True), ("enable_sleep_mode", False), ("disable_log_stats", True),
    ("disable_log_stats", False), ("enable_chunked_prefill", True), ("enable_chunked_prefill", None),
    ("swap_space", 0), ("swap_space", 4), ("swap_space", 2.5), ("swap_space", np.int64(4)), ("tokenizer_mode", "auto"), ("tokenizer_mode", "hf"),
    ("task", "auto"), ("distributed_executor_backend", None),
    ("distributed_executor_backend", "uni"), ("distributed_executor_backend", "mp"),
    ("distributed_executor_backend", "external_launcher"), ("logprobs_mode", "raw_logprobs"),
])
def test_accepted_vllm_arguments_change_nothing(name, value):
    assert EngineConfig.from_kwargs(**{name: value}) == EngineConfig.from_kwargs()


@pytest.mark.parametrize("name, value, expected", [
    ("enable_sleep_mode", "yes", "True or False"),
    ("disable_log_stats", 1, "True or False"),
    ("enable_chunked_prefill", False, "always splits long prompts into chunks"),
    ("swap_space", -1, "a finite non-negative number"),
    ("swap_space", True, "a finite non-negative number"),
    ("swap_space", float("inf"), "a finite non-negative number"),
    ("swap_space", float("nan"), "a finite non-negative number"),
    ("tokenizer_mode", "mistral", "'auto' or 'hf'.*'mistral'.*not supported"),
    ("task", "classify", "'auto', 'generate' or 'embed'"),
    ("task", ["embed"], "'auto', 'generate' or 'embed'"),
    ("distributed_executor_backend", "ray", "None, 'uni'.*'mp'.*'external_launcher'"),
    ("logprobs_mode", "processed_logprobs", "'raw_logprobs'.*raw logits, before temperature"),
    ("logprobs_mode", "raw_logits", "'raw_logprobs'"),
])
def test_other_values_are_refused_naming_the_argument_and_what_is_accepted(name, value, expected):
    shown = re.escape(f"{name}={value!r}")
    with pytest.raises(ValueError, match=rf"{shown} is not supported; expected .*{expected}"):
        EngineConfig.from_kwargs(**{name: value})


def test_executor_backends_must_match_the_parallel_sizes():
    EngineConfig.from_kwargs(distributed_executor_backend="mp", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"distributed_executor_backend='uni' runs one rank in this process, but the "
                                         r"parallel sizes ask for 2 ranks; use 'mp'"):  # not "expected ... 'uni'"
        EngineConfig.from_kwargs(distributed_executor_backend="uni", tensor_parallel_size=2)
    # outside torchrun (fxrewrite.distributed.init_from_env) a TP engine starts its own worker processes
    with pytest.raises(ValueError, match=r"distributed_executor_backend='external_launcher' is not supported"):
        EngineConfig.from_kwargs(distributed_executor_backend="external_launcher", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"distributed_executor_backend='external_launcher' is not supported"):
        EngineConfig.from_kwargs(distributed_executor_backend="external_launcher", data_parallel_size=2)


def test_task_selects_the_runner():
    assert EngineConfig.from_kwargs(task="embed").runner == "pooling"
    assert EngineConfig.from_kwargs(task="generate").runner == "generate"
    assert EngineConfig.from_kwargs(task="auto", runner="pooling").runner == "pooling"
    assert EngineConfig.from_kwargs(task="embed", runner="pooling").runner == "pooling"
    with pytest.raises(ValueError, match=r"task='embed' selects runner='pooling', but runner='generate' was given"):
        EngineConfig.from_kwargs(task="embed", runner="generate")


def test_unknown_arguments_list_the_compat_ones_too():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'swap_spaces'; accepted: .*swap_space"):
        EngineConfig.from_kwargs(swap_spaces=4)


def test_accepted_arguments_are_noted_in_the_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="fxrewrite.runtime.engine_config"):
        EngineConfig.from_kwargs(swap_space=4)
    assert "swap_space=4" in caplog.text and "no CPU swap space" in caplog.text
