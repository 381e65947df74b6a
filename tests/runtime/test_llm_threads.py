"""`LLM.generate` from several threads at once runs the calls one after another (each got KeyErrors or "token is
neither on the host nor in flight": the engine steps every request it holds, so two loops took each other's); a
request's params of the wrong type are a TypeError naming them."""

import threading

import pytest

from fxrewrite.errors import UserTypeError
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM


def test_generate_from_four_threads_equals_one_at_a_time(tiny_qwen3_dir):
    llm = LLM(str(tiny_qwen3_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {i: llm.generate([f"p{i}"], params, use_tqdm=False)[0].outputs[0].token_ids for i in range(4)}
    got, errors = {}, []

    def run(i):
        try:
            got[i] = llm.generate([f"p{i}"], params, use_tqdm=False)[0].outputs[0].token_ids
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want
    with pytest.raises(UserTypeError, match="sampling_params='notparams': expected a SamplingParams"):
        llm.llm_engine.add_request("r", "hello", "notparams")
