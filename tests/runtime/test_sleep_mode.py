"""`LLM.sleep` / `wake_up` on a CPU: the KV cache's memory and the cached prefixes are released, level 2
discards the weights until `load_weights`, and generation after waking equals generation before."""

import pytest
import torch

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.worker.sleep_mode import storage_bytes

PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _kv_bytes(llm):
    return storage_bytes(k for pair in llm.llm_engine.model_runner.kv_caches for k in pair)


def _weight_bytes(llm):
    return storage_bytes(llm.llm_engine.model_runner.model.parameters())


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen3", vocab="smollm2")), model_impl="transformers", dtype="float32",
               block_size=4, kv_cache_memory_bytes=1 << 20)


def test_wake_up_without_sleep_is_a_no_op(llm):
    before = _tokens(llm)
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping() and _tokens(llm) == before


def test_level1_frees_kv_cache_and_prefixes_then_generates_the_same(llm):
    before = _tokens(llm)
    kv, weights = _kv_bytes(llm), _weight_bytes(llm)
    bm = llm.llm_engine.block_manager
    assert kv > 0 and bm.hash_to_block_id
    llm.sleep(level=1)
    llm.sleep(level=1)  # a second sleep does nothing
    assert llm.llm_engine.is_sleeping()
    assert _kv_bytes(llm) == 0 and _weight_bytes(llm) == weights  # CPU: the weights are host memory already
    assert not bm.hash_to_block_id and bm.num_free_blocks == bm.num_blocks
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping() and _kv_bytes(llm) == kv
    assert _tokens(llm) == before


def test_level2_discards_weights_until_load_weights(llm):
    before = _tokens(llm)
    saved = [(n, p.detach().clone()) for n, p in llm.llm_engine.model_runner.model.named_parameters()]
    weights = _weight_bytes(llm)
    llm.sleep(level=2)
    assert _kv_bytes(llm) == 0 and _weight_bytes(llm) == 0
    with pytest.raises(RuntimeError, match="asleep"):
        llm.load_weights(saved)
    llm.wake_up(["weights"])  # weights back first (vLLM's RL order), KV cache after the update
    assert _weight_bytes(llm) == weights and _kv_bytes(llm) == 0
    llm.load_weights(saved)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert _tokens(llm) == before


def test_level2_then_full_wake_up_refuses_requests_until_weights_arrive(llm):
    before = _tokens(llm)
    saved = [(n, p.detach().clone()) for n, p in llm.llm_engine.model_runner.model.named_parameters()]
    llm.sleep(level=2)
    assert llm.llm_engine.is_sleeping()
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()  # vLLM's answer once every part is awake; the weights are still garbage
    with pytest.raises(RuntimeError, match="load_weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=1)  # asleep again (the garbage weights are not worth keeping: freed as at level 2)
    assert llm.llm_engine.is_sleeping() and _kv_bytes(llm) == 0 and _weight_bytes(llm) == 0
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    with pytest.raises(RuntimeError, match="load_weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights(saved)
    assert not llm.llm_engine.is_sleeping() and _tokens(llm) == before


def test_level2_then_weights_in_buckets_with_strict_false(llm):
    """RL frameworks send the weights in buckets, each load_weights(strict=False): the engine serves again once
    the buckets together have written every parameter (a fused one through its shards too), not before."""
    before = _tokens(llm)
    model = llm.llm_engine.model_runner.model
    saved = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    hf_names = [(n, t.detach().clone()) for n, t in model.hf_model.state_dict().items()]  # views: copied now
    llm.sleep(level=2)
    llm.wake_up()
    half = len(saved) // 2
    llm.load_weights(saved[:half], strict=False)
    with pytest.raises(RuntimeError, match="in several with strict=False"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights(saved[half:], strict=False)
    assert _tokens(llm) == before
    llm.sleep(level=2)  # again, through Hugging Face names: shards of the fused tensors written one by one
    llm.wake_up()
    shards = [(n, t) for n, t in hf_names if "q_proj" in n or "k_proj" in n]
    llm.load_weights(shards, strict=False)
    llm.load_weights([(n, t) for n, t in saved if "qkv_proj" not in n], strict=False)
    with pytest.raises(RuntimeError, match="load_weights"):  # v_proj's shard still missing
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights([(n, t) for n, t in hf_names if "v_proj" in n], strict=False)
    assert _tokens(llm) == before


def test_bad_level_and_tag(llm):
    for bad in (3, 1.0, True, "1"):  # the int 1 or 2 only (True == 1 and 1.0 == 1 were taken for level 1)
        with pytest.raises(ValueError, match=f"sleep level={bad!r} must be 1"):
            llm.sleep(level=bad)
    assert not llm.llm_engine.is_sleeping()
    llm.sleep()
    llm.sleep(level=1)  # again at the same level: nothing to do
    with pytest.raises(ValueError, match=r"sleep\(level=2\): already asleep at level 1; call wake_up\(\) first"):
        llm.sleep(level=2)  # it would have kept the weights silently
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["kv"])
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
