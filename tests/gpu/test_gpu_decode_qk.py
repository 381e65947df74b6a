"""q/k norm + rotary + cache write inside the paged decode kernel (FXREWRITE_DECODE_QK=on) on the GPU: at Qwen3-4B's
heads, compiled, launched with PDL inside a captured CUDA graph, the fused kernel's output and caches are bitwise the
unfused pair's (qk_norm_rope_cache, then the decode kernel); a bf16 Qwen3 engine with CUDA graphs gives bitwise the
same greedy tokens and log-probs with the switch on as off. CPU tests: tests/kernels/test_decode_qk_norm_rope.py,
tests/runtime/test_decode_launches.py."""

from __future__ import annotations

import pytest
import torch

from fxrewrite.kernels.paged_attention import paged_attention_qk_norm_rope
from fxrewrite.kernels.pdl import device_supports_pdl
from tests.kernels.conftest import make_paged_batch
from tests.kernels.test_rotary import make_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pdl", ["off", "on"])
def test_fused_decode_equals_pair_in_a_graph(monkeypatch, pdl):
    if pdl == "on" and not device_supports_pdl("cuda"):
        pytest.fail("FXREWRITE_PDL=on needs compute capability >= 9.0")
    monkeypatch.setenv("FXREWRITE_PDL", pdl)
    contexts, hq, hkv, dim = [5, 127, 200, 1000, 4000], 32, 8, 128
    batch = make_paged_batch([(c, 1) for c in contexts], hq, hkv, dim, 16, dtype=torch.bfloat16, device="cuda")
    positions = torch.tensor(contexts, device="cuda")
    tables = batch.block_tables.long()
    slots = tables[torch.arange(len(contexts), device="cuda"), positions // 16] * 16 + positions % 16
    qkv = torch.randn(len(contexts), (hq + 2 * hkv) * dim, device="cuda", dtype=torch.bfloat16)
    weights = [(torch.rand(dim, device="cuda") + 0.5).to(torch.bfloat16) for _ in "qk"]
    cos_sin = make_cache(8192, dim).cuda()

    def step(fused: bool):
        monkeypatch.setenv("FXREWRITE_DECODE_QK", "on" if fused else "off")
        kc, vc, x = batch.key_cache.clone(), batch.value_cache.clone(), qkv.clone()
        q, k, v = x.split([hq * dim, hkv * dim, hkv * dim], dim=-1)

        def run():
            return (paged_attention_qk_norm_rope(positions, q, k, v, *weights, 1e-6, dim, cos_sin, True, kc, vc, slots,
                                                 batch.block_tables, batch.seq_lens, batch.query_start_loc, 1,
                                                 max(contexts) + 1, dim ** -0.5, static_metadata=True), kc, vc)

        run()  # eager (compiles), then the same in a captured graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        graph.replay()
        torch.cuda.synchronize()
        return [o.float().nan_to_num(7.0) for o in outs]

    fused, pair = step(True), step(False)
    assert not fused[0].isnan().any()
    for got, want in zip(fused, pair):
        assert torch.equal(got, want)


def test_engine_tokens_with_the_switch_equal_without(tmp_path, monkeypatch):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.model_files.demo import build_model_dir

    path = build_model_dir(tmp_path / "qwen3", "qwen3", hidden_size=2560, num_hidden_layers=2, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab="qwen3")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [list(range(100, 400)), [7, 8, 9]]
    runs = {}
    for value in ("off", "on"):  # captured at load: one engine per value
        monkeypatch.setenv("FXREWRITE_DECODE_QK", value)
        llm = LLM(str(path), model_impl="native", dtype="bfloat16", max_model_len=1024,
                  kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[value] = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                       for step in o.outputs[0].logprobs]) for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert runs["on"] == runs["off"]
