"""Regional torch.compile of the decoder layers (attention as the `fxrewrite::paged_attend` custom op)."""

from __future__ import annotations

import pytest
import torch


def test_custom_op_is_registered():
    import fxrewrite.runtime.worker.compilation  # noqa: F401

    assert hasattr(torch.ops.fxrewrite, "paged_attend")


def test_compilation_config_is_checked():
    from fxrewrite.runtime.worker.compilation import should_compile
    from fxrewrite.runtime.engine_config import EngineConfig

    assert not should_compile(EngineConfig(compilation_config=3), torch.device("cpu"))
    assert should_compile(EngineConfig(compilation_config=3), torch.device("cuda"))
    assert not should_compile(EngineConfig(compilation_config=3, enforce_eager=True), torch.device("cuda"))
    assert not should_compile(EngineConfig(), torch.device("cuda"))  # opt-in: compiling is slow for now
    with pytest.raises(ValueError, match="compilation_config"):
        should_compile(EngineConfig(compilation_config=7), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("impl,fusion", [("native", True), ("transformers", True)])
def test_compiled_forward_matches_eager(make_llm, impl, fusion):
    from tests.gpu.conftest import decode_batch
    from fxrewrite.runtime.worker.forward_context import forward_context
    from fxrewrite.runtime.worker.memory_profiling import _dummy_metadata

    llm = make_llm(model_impl=impl, fusion=fusion, max_num_seqs=2, compilation_config=3)  # 2 buckets
    runner = llm.llm_engine.model_runner
    model = runner.model
    assert getattr(model, "_fxrewrite_compiled", False), "compile fell back to eager"
    from fxrewrite.runtime.worker.compilation import decoder_layers

    assert all(hasattr(layer.forward, "_fxrewrite_compiled_layer") for layer in decoder_layers(model))

    def eager_forward(ids, pos):
        with torch.compiler.set_stance("force_eager"):
            return model(ids, pos)
    device = runner.device
    pos, meta, _ = _dummy_metadata(300, 120, runner.block_size, device)  # varlen prefill: 120, 120, 60
    meta.kv_caches = runner.kv_caches
    ids = torch.randint(0, 10000, (300,), device=device)
    with torch.inference_mode():
        with forward_context(meta):
            compiled = model(ids, pos)
            eager = eager_forward(ids, pos)
        ids, pos, meta = decode_batch(runner, 5)
        with forward_context(meta):
            compiled_decode = model(ids, pos)
            eager_decode = eager_forward(ids, pos)
    for a, b in ((compiled, eager), (compiled_decode, eager_decode)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-3, err
    assert getattr(model, "_fxrewrite_compiled", False)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_compiled_engine_greedy_tokens_equal_level_0(make_llm, impl):
    """float32: `-O 3` (compiled layers, CUDA graphs over them) samples the greedy tokens of `-O 0` (CUDA
    graphs over the eager forward), through prefill, chunked prefill and decode buckets 1..4."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    prompts = [[int(t) for t in torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 40, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for level in (0, 3):
        llm = make_llm(model_impl=impl, max_num_seqs=4, max_num_batched_tokens=256, compilation_config=level)
        runner = llm.llm_engine.model_runner
        assert runner.model_config.dtype == torch.float32
        assert bool(getattr(runner.model, "_fxrewrite_compiled", False)) == (level == 3)
        assert runner.graph_runner is not None
        tokens[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[3] == tokens[0]
