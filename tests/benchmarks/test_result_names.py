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
