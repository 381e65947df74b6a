"""The compare JSON's file name carries every setting that makes two runs of one config differ."""

import datetime

from fxrewrite.benchmarks.compare import _result_stem


def test_result_stem_names_parallel_sizes_quantization_and_compile_level():
    today = datetime.date.today().isoformat()
    assert _result_stem("qwen3-0.6b", "throughput", {}) == f"{today}-qwen3-0.6b-throughput"
    assert _result_stem("qwen3-0.6b", "throughput", {"compilation_config": 3}) == f"{today}-qwen3-0.6b-throughput-O3"
    kw = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 1,
          "enable_expert_parallel": True, "quantization": "fp8", "compilation_config": 0}
    assert _result_stem("m", "latency", kw) == f"{today}-m-latency-tp2-pp2-ep-fp8"


def test_an_object_override_gets_a_name_of_its_own():
    """fresh-user report: a quantization_config override (an object) left the name as the plain config's, so a
    block-scaled run overwrote the per-channel one."""
    from fxrewrite.benchmarks.compare import _override_tag

    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    tag = _override_tag("quantization_config", block)
    assert tag.startswith("-quantization_config-") and len(tag) == len("-quantization_config-") + 8
    assert tag == _override_tag("quantization_config", dict(reversed(block.items())))  # key order does not matter
    assert tag != _override_tag("quantization_config", {**block, "weight_block_size": [64, 64]})
    assert _override_tag("num_hidden_layers", 2) == "-2layers" and _override_tag("rope_theta", 5.0) == "-rope_theta5.0"


def test_the_hf_arm_is_skipped_where_it_would_run_another_model():
    from fxrewrite.benchmarks.compare import run_arm

    for kw, named in (({"quantization": "fp8"}, "quantization='fp8'"), ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'")):
        figures = run_arm("hf", None, {}, None, kw, None, 4)
        assert set(figures) == {"skipped"} and named in figures["skipped"]
    block = {"config": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}}
    assert "quantization_config" in run_arm("hf", None, block, None, {}, None, 4)["skipped"]


def test_results_record_the_commit_that_produced_them():
    """fresh-user report: a result JSON named the library versions but not fxrewrite's own code."""
    import subprocess
    from pathlib import Path

    from fxrewrite.benchmarks.common import environment

    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    revision = environment()["fxrewrite"]
    assert revision["commit"] == (head or None) and revision["version"]
    assert isinstance(revision["dirty"], bool) or head == ""
