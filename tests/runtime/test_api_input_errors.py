"""Bad input to the offline API found by a new-user session: each is a clear TypeError/ValueError
naming the value, raised before anything runs, and vLLM's dict prompts are accepted."""

import numpy as np
import pytest

from fxrewrite import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    return LLM(str(tiny_qwen3_dir), kv_cache_memory_bytes=1 << 22, max_model_len=256)


def test_stop_must_be_strings():
    with pytest.raises(TypeError, match="stop=5"):
        SamplingParams(stop=5)
    with pytest.raises(TypeError, match="stop="):
        SamplingParams(stop=["a", 3])


def test_prompts_of_the_wrong_type_name_the_value(llm):
    with pytest.raises(TypeError, match="prompts=123"):
        llm.generate(123, use_tqdm=False)


def test_vllm_dict_prompts_equal_plain_prompts(llm):
    params = SamplingParams(max_tokens=6, temperature=0)
    ids = llm.get_tokenizer().encode("The capital of France is")
    plain = llm.generate(["The capital of France is", ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]


def test_chat_message_without_role_is_refused(llm):
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"rol": "user", "content": "hi"}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_input_shapes_are_checked(llm):
    with pytest.raises(TypeError, match="messages must be a non-empty list.*str 'hello'"):
        llm.chat("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="message 0: .* 'content'"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    with pytest.raises(ValueError, match="message 0: .* 'content' that is not None"):
        llm.chat([{"role": "user", "content": None}], use_tqdm=False)
    with pytest.raises(TypeError, match="conversation 1: 'hi' must be a list"):
        llm.chat([[{"role": "user", "content": "a"}], "hi"], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_params_of_the_wrong_type_name_the_type(llm):
    with pytest.raises(TypeError, match="got dict {'max_tokens': 3}"):
        llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got int 5"):
        llm.generate(["a", "b"], [SamplingParams(), 5], use_tqdm=False)


def test_dict_prompt_without_a_prompt_key_is_named(llm):
    with pytest.raises(ValueError, match="prompt 1: {'text': 'hi'} has neither 'prompt' nor 'prompt_token_ids'"):
        llm.generate(["a", {"text": "hi"}], use_tqdm=False)


def test_token_id_lists_name_the_bad_element(llm):
    with pytest.raises(TypeError, match="prompt 0: prompt token ids must be ints: element 2 is float 3.5"):
        llm.generate([[1, 2, 3.5]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: prompt token ids must be ints: element 1 is bool True"):
        llm.generate([{"prompt_token_ids": [5, True]}], use_tqdm=False)  # as the server refuses [true]
    assert not llm.llm_engine.has_unfinished_requests()
    numpy_ids = llm.generate([list(np.array([5, 6], dtype=np.int64))], SamplingParams(max_tokens=1), use_tqdm=False)
    assert numpy_ids[0].prompt_token_ids == [5, 6] and all(type(t) is int for t in numpy_ids[0].prompt_token_ids)


def test_another_models_tokenizer_is_refused_or_warned_of(tiny_model_dir, tiny_qwen3_dir, caplog):
    """Another model's tokenizer, larger than the model's vocabulary: a text prompt's ids are checked as token-id
    prompts are (a fresh user got an IndexError from the embedding); smaller: a warning at load (the ids past it
    decode to no text)."""
    small = tiny_model_dir("qwen3", vocab="smollm2")
    llm = LLM(str(small), tokenizer=str(tiny_qwen3_dir), kv_cache_memory_bytes=1 << 22, max_model_len=256)
    with pytest.raises(ValueError, match=r"prompt 0: prompt token id \d+ \(the tokenizer's\) is out of range "
                                         r"\[0, 49152\): the tokenizer does not fit"):
        llm.generate(["你好世界"], use_tqdm=False)
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert "decode to no text" not in caplog.text
    LLM(str(tiny_qwen3_dir), tokenizer=str(small), kv_cache_memory_bytes=1 << 22, max_model_len=256)
    assert "has 49152 tokens, the model 151936: sampled ids past the tokenizer's decode to no text" in caplog.text


def test_prompt_token_ids_that_are_no_list_are_refused_by_their_key(llm):
    """A string under prompt_token_ids was served as text (found by a fresh-user run); a tensor was refused under
    the name `prompt`."""
    with pytest.raises(TypeError, match="prompt 0: prompt_token_ids must be a list of token ids \\(ints\\), got str"):
        llm.generate([{"prompt_token_ids": "abc"}], use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompt 1: prompt_token_ids .* got ndarray .*\(convert it with \.tolist\(\)\)"):
        llm.generate(["a", {"prompt_token_ids": np.array([5, 6])}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_multi_modal_data_is_refused_not_dropped(llm):
    with pytest.raises(ValueError, match="prompt 0: multi_modal_data is not supported"):
        llm.generate([{"prompt": "Describe it.", "multi_modal_data": {"image": object()}}], use_tqdm=False)


def test_tensor_parallel_size_must_divide_heads_before_any_worker_starts(tiny_qwen3_dir):
    # the tiny Qwen3 has 4 attention heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=4"):
        LLM(str(tiny_qwen3_dir), tensor_parallel_size=3, kv_cache_memory_bytes=1 << 22)


def test_a_kv_cache_larger_than_memory_is_a_user_error(tiny_qwen3_dir, monkeypatch):
    """The allocator's failure (CPU: a RuntimeError "can't allocate memory") becomes one error naming the size."""
    from fxrewrite.errors import UserInputError
    from fxrewrite.runtime.worker import kv_cache

    zeros = kv_cache.torch.zeros

    def refuse(shape, *args, **kwargs):  # only the cache's [2, layers, blocks, block_size, heads, head_dim]
        if isinstance(shape, tuple) and len(shape) == 6:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        return zeros(shape, *args, **kwargs)

    monkeypatch.setattr(kv_cache.torch, "zeros", refuse)
    with pytest.raises(UserInputError, match=r"the KV cache of \d+ blocks of block_size=16 tokens \(0\.0 GiB\) does not "
                                             "fit in cpu's memory; lower kv_cache_memory_bytes, gpu_memory_utilization "
                                             "or block_size"):
        LLM(str(tiny_qwen3_dir), kv_cache_memory_bytes=1 << 22, max_model_len=256)


def test_boolean_engine_arguments_must_be_bools():
    import pytest

    from fxrewrite.runtime.engine_config import EngineConfig

    for name in ("async_scheduling", "fusion", "enforce_eager"):
        with pytest.raises(ValueError, match=f"{name}='maybe' must be True or False"):
            EngineConfig(**{name: "maybe"})


@pytest.mark.parametrize("name", ["max_num_seqs", "block_size", "max_num_batched_tokens", "max_model_len",
                                  "max_logprobs", "tensor_parallel_size", "pipeline_parallel_size"])
def test_a_boolean_is_not_a_count(name):
    from fxrewrite.runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match=f"{name}=True must be a positive integer"):
        EngineConfig(**{name: True})


@pytest.mark.parametrize("seed", ["1", True, 1.5])
def test_seed_must_be_an_integer(seed):
    from fxrewrite.runtime.engine_config import EngineConfig

    with pytest.raises(TypeError, match=f"seed={seed!r} must be an integer"):
        EngineConfig(seed=seed)


def test_seed_is_none_or_a_64_bit_integer():
    """vLLM's LLM(seed=None) seeds with 0; a seed torch cannot take is refused before any model loads (a fresh user
    got torch's "Overflow when unpacking long long" traceback from the model runner)."""
    from fxrewrite.runtime.engine_config import EngineConfig

    assert EngineConfig(seed=None).seed == 0 and EngineConfig(seed=-(2**63)).seed == -(2**63)
    for seed in (2**63, -(2**63) - 1, 10**23):
        with pytest.raises(ValueError, match=rf"seed={seed} must be in \[-9223372036854775808, 9223372036854775807\]"):
            EngineConfig(seed=seed)


@pytest.mark.parametrize("value", ["0.5", True])
def test_gpu_memory_utilization_must_be_a_number(value):
    from fxrewrite.runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match=f"gpu_memory_utilization={value!r} must be in"):
        EngineConfig(gpu_memory_utilization=value)


def test_chat_message_with_an_unknown_role_is_refused(llm):
    with pytest.raises(ValueError, match="role 'wizard' is not one of"):
        llm.chat([{"role": "wizard", "content": "hi"}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_over_long_prompt_is_the_engines_error_only(tiny_qwen3_dir, tmp_path, capfd):
    """transformers' tokenizer warns about any sequence longer than tokenizer_config's model_max_length
    (which also caps the derived max_model_len); the engine checks max_model_len itself, so an over-long
    prompt gets the engine's clear error and nothing else (issue 15 item 8)."""
    import json
    import logging
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    short = LLM(str(folder), kv_cache_memory_bytes=1 << 22)
    assert short.llm_engine.model_config.max_model_len == 64
    heard = []

    class Collect(logging.Handler):
        def emit(self, record):
            heard.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    logging.getLogger("transformers").addHandler(handler)  # transformers' library logger (no propagation)
    try:
        capfd.readouterr()
        with pytest.raises(ValueError, match="max_model_len=64"):
            short.generate(" ".join(["word"] * 100), SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    said = capfd.readouterr().err + "\n".join(heard)
    assert "Token indices sequence length" not in said


def test_batch_invariant_with_tensor_parallelism_warns(caplog):
    """The kernels are batch-invariant, an all-reduce between ranks is not: the user is told, not refused."""
    from fxrewrite.runtime.engine_config import EngineConfig

    with caplog.at_level("WARNING", logger="fxrewrite.runtime.engine_config"):
        EngineConfig.from_kwargs(batch_invariant=True, tensor_parallel_size=2)
    assert "all-reduce between ranks is not" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fxrewrite.runtime.engine_config"):
        EngineConfig.from_kwargs(batch_invariant=True)
    assert caplog.text == ""


def test_dtype_of_the_wrong_type_names_it():
    from fxrewrite.runtime.engine_config import EngineConfig

    with pytest.raises(TypeError, match=r"dtype=5 must be a string or a torch.dtype"):
        EngineConfig.from_kwargs(dtype=5)


def test_block_size_none_is_the_default():
    """fresh-user report: block_size=None passed the checks and failed at the KV-cache allocation with torch's
    TypeError; as in vLLM, None is the default block size."""
    from fxrewrite.runtime.engine_config import DEFAULT_BLOCK_SIZE, EngineConfig

    assert EngineConfig(model="unused", block_size=None).block_size == DEFAULT_BLOCK_SIZE == 16
