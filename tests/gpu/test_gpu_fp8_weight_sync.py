"""RL weight sync into an FP8 engine on the GPU, where the layers keep e4m3 weights and scales (on a CPU they are
dequantized; `tests/quantization/test_fp8_weight_sync.py`): syncing the float weights an engine serves re-quantizes
them to the same bytes, so its greedy tokens and log-probabilities stay as they were, under CUDA graphs (the
parameters are written in place). Before, the float tensors were cast into e4m3 without scales."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _logprobs(llm):
    from fxrewrite.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([list(range(100, 140)), [5, 6, 7]], params, use_tqdm=False)
    return [(t, lp[t].logprob) for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]


@pytest.mark.parametrize("checkpoint", ["online", "block"])
def test_syncing_the_served_weights_changes_nothing(tmp_path, checkpoint):
    from transformers import AutoModelForCausalLM

    from fxrewrite.runtime.llm import LLM
    from fxrewrite.runtime.model_files.demo import build_model_dir
    from fxrewrite.runtime.model_files.fp8_checkpoint import write_fp8_checkpoint

    src = build_model_dir(tmp_path / "bf16", "qwen3", hidden_size=512, num_attention_heads=4, head_dim=128,
                          num_key_value_heads=2, intermediate_size=1024, vocab="qwen3", dtype=torch.bfloat16)
    folder, kwargs = (src, {"quantization": "fp8"}) if checkpoint == "online" else (
        write_fp8_checkpoint(src, tmp_path / "fp8"), {})
    llm = LLM(str(folder), dtype="bfloat16", gpu_memory_utilization=0.3, **kwargs)
    model = llm.llm_engine.model_runner.model
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    before = _logprobs(llm)
    # The float weights the checkpoint was made from: per-row scales as at load, or 128 x 128 blocks over each fused
    # layer, whose parts (512 / 256 / 256 q / k / v rows, 1024 gate / up) start on block rows as the checkpoint's do.
    llm.load_weights(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32))
    after = _logprobs(llm)
    assert [t for t, _ in after] == [t for t, _ in before]
    assert [lp for _, lp in after] == pytest.approx([lp for _, lp in before], abs=0.02)
