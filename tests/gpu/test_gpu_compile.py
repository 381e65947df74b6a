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
@pytest.mark.parametrize("forwards", ["compiled", "auto"])
def test_compiled_engine_greedy_tokens_equal_level_0(make_llm, impl, forwards, monkeypatch):
    """float32: `-O 3` (compiled layers, CUDA graphs over them) samples the greedy tokens of `-O 0` (CUDA
    graphs over the eager forward), through prefill, chunked prefill and decode buckets 1..4. "compiled": every
    step runs the compiled forward; "auto" (the default): each decode bucket was captured both ways, timed, and
    holds the faster, and the other steps run the forward that was faster on a full chunk at load."""
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    monkeypatch.setenv("FXREWRITE_COMPILED_FORWARD", forwards)

    prompts = [[int(t) for t in torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 40, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for level in (0, 3):
        llm = make_llm(model_impl=impl, max_num_seqs=4, max_num_batched_tokens=256, compilation_config=level)
        runner = llm.llm_engine.model_runner
        assert runner.model_config.dtype == torch.float32
        assert bool(getattr(runner.model, "_fxrewrite_compiled", False)) == (level == 3)
        graphs = runner.graph_runner
        assert graphs is not None
        if level == 0:
            assert runner.step_forward == "model"
            assert set(graphs.forward_kind.values()) == {"model"} and not graphs.replay_ms
        elif forwards == "compiled":
            assert runner.step_forward == "compiled" and not runner.step_forward_seconds
            assert set(graphs.forward_kind.values()) == {"compiled"} and not graphs.replay_ms
        else:
            assert set(runner.step_forward_seconds) == {"compiled", "eager"}
            assert runner.step_forward == min(runner.step_forward_seconds, key=runner.step_forward_seconds.get)
            assert set(graphs.forward_kind.values()) <= {"compiled", "eager"}
            assert set(graphs.replay_ms) == set(graphs.graphs) == set(graphs.forward_kind)
            assert all(min(t, key=t.get) == graphs.forward_kind[bs] for bs, t in graphs.replay_ms.items())
        tokens[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[3] == tokens[0]


SMALL_QWEN3_MOE = {  # Qwen3-MoE with real head size and GQA, 16 experts, float32 (compiled vs eager agree tightly)
    "name": "gpu-small-qwen3-moe",
    "tokenizer": "qwen3",
    "config": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512,
        "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 16, "num_experts_per_tok": 4,
        "norm_topk_prob": True, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": True, "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "float32",
    },
}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_compiled_deep_engine_compiles_once_per_layer_kind_and_equals_level_0(fxrewrite_cache, arch):
    """10 decoder layers (more than dynamo's recompile limit, 8) through the transformers backend at `-O 3`: every
    layer reuses one compiled graph per token-count kind (nothing guards on the layer's index), nothing breaks the
    graph (an MoE model's fused experts are the custom op ``fxrewrite::fused_experts``), and the greedy tokens equal
    `-O 0`'s through prefill, chunked prefill and decode."""
    from torch._dynamo.utils import counters

    from fxrewrite.benchmarks.common import bench_model_dir
    from fxrewrite.layers.fused_moe import FusedMoE
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from tests.e2e.compile_breaks import graph_breaks
    from tests.gpu.conftest import REPO_ROOT, SMALL_QWEN3

    spec = dict(SMALL_QWEN3_MOE if arch == "qwen3_moe" else SMALL_QWEN3)
    spec["config"] = {**spec["config"], "num_hidden_layers": 10}
    spec["name"] += "-10-layers"
    carried = REPO_ROOT / ".bench_tokenizer" / "qwen3"
    path = bench_model_dir(spec, carried if carried.is_dir() else None)
    prompts = [[int(t) for t in torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 40, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for level in (0, 3):
        torch._dynamo.reset()
        counters.clear()
        llm = LLM(str(path), model_impl="transformers", load_format="dummy", kv_cache_memory_bytes=256 << 20,
                  max_model_len=1024, seed=0, max_num_seqs=4, max_num_batched_tokens=256, compilation_config=level)
        runner = llm.llm_engine.model_runner
        assert bool(getattr(runner.model, "_fxrewrite_compiled", False)) == (level == 3)
        assert any(isinstance(m, FusedMoE) for m in runner.model.modules()) == (arch == "qwen3_moe")
        tokens[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert graph_breaks() == {}, graph_breaks()
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # any T, and T = 1
        del llm, runner
    assert tokens[3] == tokens[0]
