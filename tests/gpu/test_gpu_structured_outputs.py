"""Structured outputs and prompt logprobs on the GPU: the sampler's bitmask kernel equals its torch reference,
sampled JSON validates with async scheduling and CUDA graphs, prompt logprobs are finite and ranked."""

from __future__ import annotations

import json

import pytest
import torch

from fxrewrite.runtime.engine.sampler import apply_token_bitmask, apply_token_bitmask_reference

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{0,7}$"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False,
}


def test_bitmask_kernel_matches_reference():
    """The sampler's CUDA path (xgrammar's Triton kernel) equals the torch reference, bf16 and float32."""
    vocab = 151936
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(8, vocab, device="cuda", dtype=dtype)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (8, (vocab + 31) // 32), dtype=torch.int32, device="cuda")
        bitmask[3] = -1
        ours, reference = logits.clone(), logits.clone()
        apply_token_bitmask(ours, bitmask)
        apply_token_bitmask_reference(reference, bitmask)
        assert torch.equal(ours, reference) and torch.equal(ours[3], logits[3])


@pytest.mark.parametrize("shared", [False, True])
def test_mask_copies_on_the_side_stream_keep_stream_order(shared):
    """Masks copied on the side stream into the two reused device buffers: each reader on the busy compute
    stream (the sampler) sees its own step's mask, never the next one's nor a partly copied one; from
    pinned slots and from the grammar process's shared slots (registered with CUDA)."""
    from fxrewrite.runtime.engine.grammar_bitmask import MaskSlots

    device, seen, registered = torch.device("cuda"), [], []
    shared_slots = torch.zeros(2, 64, 4748, dtype=torch.int32) if shared else None

    def pin():
        ptr = shared_slots.data_ptr()
        assert int(torch.cuda.cudart().cudaHostRegister(ptr, shared_slots.numel() * 4, 0)) == 0
        registered.append(ptr)

    slots = MaskSlots(4748, shared_slots, pin if shared else None)
    for step in range(8):
        _, host, event = slots.next(64, device)
        host.fill_(step)
        torch.cuda._sleep(1_000_000)  # the compute stream is still busy (a forward pass)
        seen.append(slots.to_device(host, event, device).clone())  # read on the compute stream
    torch.cuda.synchronize()
    assert [bool((mask == step).all()) for step, mask in enumerate(seen)] == [True] * 8
    assert len(registered) == int(shared)
    for ptr in registered:
        torch.cuda.cudart().cudaHostUnregister(ptr)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_sampled_json_validates_on_gpu(make_llm, async_scheduling):
    jsonschema = pytest.importorskip("jsonschema")
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

    llm = make_llm(model_impl="native", async_scheduling=async_scheduling)
    params = SamplingParams(n=200, temperature=1.0, max_tokens=200, seed=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    out = llm.generate(["JSON please:"], params, use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_prompt_logprobs_on_gpu(make_llm):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    llm = make_llm(model_impl="native", max_num_batched_tokens=64)
    prompt = list(range(1000, 1200))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p, step in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[p] in step and len(step) in (5, 6)
        assert all(lp.logprob <= 0 and lp.rank >= 1 for lp in step.values())


def test_grammar_process_keeps_seeded_outputs_on_gpu(make_llm):
    """The grammar-process path (shared slots registered with CUDA, the reused device bitmask, CUDA events,
    the sample launched at the next step's launch) gives the seeded tokens of the sequential path (the
    matchers in the engine's process), with CUDA graphs and async scheduling, at batch 64."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams

    llm = make_llm(model_impl="native")
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i, structured_outputs=constraint if i % 4 else None)
              for i in range(64)]
    prompts = [f"item {i} as JSON:" for i in range(64)]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    overlapped = tokens()
    engine = llm.llm_engine
    structured = engine._structured
    assert structured.process is not None and structured.stats["job_s"] > 0  # jobs ran in the process
    engine._structured = type(structured)(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                                          use_process=False)
    try:
        assert tokens() == overlapped
        assert engine._structured.stats["job_s"] == 0 and not engine._structured.constrained
    finally:
        engine._structured.close()
        engine._structured = structured
