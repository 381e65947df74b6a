"""Which guards of the engine's regionally compiled decoder layer name ``layer_idx`` (GPU; one engine per arch).

Run with TORCH_LOGS=guards,recompiles; prints the recompile counters per arch."""
import sys

import torch


def main(arch: str, layers: int) -> None:
    from torch._dynamo.utils import counters

    from fxrewrite.benchmarks.common import bench_model_dir
    from fxrewrite.runtime.engine.sampling_params import SamplingParams
    from fxrewrite.runtime.llm import LLM
    from tests.gpu.conftest import REPO_ROOT, SMALL_QWEN3
    from tests.gpu.test_gpu_compile import SMALL_QWEN3_MOE

    spec = dict(SMALL_QWEN3_MOE if arch == "moe" else SMALL_QWEN3)
    spec["config"] = {**spec["config"], "num_hidden_layers": layers}
    spec["name"] += f"-{layers}"
    carried = REPO_ROOT / ".bench_tokenizer" / "qwen3"
    path = bench_model_dir(spec, carried if carried.is_dir() else None)
    counters.clear()
    llm = LLM(str(path), model_impl="transformers", load_format="dummy", kv_cache_memory_bytes=256 << 20,
              max_model_len=1024, seed=0, max_num_seqs=2, compilation_config=3)
    out = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    print(arch, out[0].outputs[0].token_ids, {k: dict(v) for k, v in counters.items()
                                                if k in ("recompiles", "graph_break", "stats")}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
