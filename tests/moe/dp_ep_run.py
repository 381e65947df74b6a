"""Subprocess entry of test_data_parallel.py's load test: `python -m tests.moe.dp_ep_run MODEL_DIR` builds a
DP2 + EP engine (the caller's environment forces the kernel warm-up and the emulated CUDA graphs), runs the
test's prompts greedily and prints one JSON line {"tokens", "buckets", "routed", "free", "layouts": each
worker's expert split (tests.moe.moe_ranks.model_moe_layout)}. A module of its
own so the test can kill it at a timeout: a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(path: str) -> None:
    import tempfile

    from tests.distributed.tp_ranks import make_llm
    from tests.moe.moe_ranks import LAYOUT_DIR_ENV, read_dp_layouts, record_dp_layouts
    from tests.moe.test_data_parallel import greedy

    torch.set_num_threads(1)
    layout_dir = os.environ.setdefault(LAYOUT_DIR_ENV, tempfile.mkdtemp())
    record_dp_layouts(setattr)  # each worker writes its experts' split once loaded
    llm = make_llm(path, "native", data_parallel_size=2, enable_expert_parallel=True, max_num_seqs=16)
    try:
        engine = llm.llm_engine
        tokens = greedy(llm)
        free = [r.block_manager.num_free_blocks == r.block_manager.num_blocks for r in engine.engines]
        print(json.dumps({"tokens": tokens, "buckets": engine.model_runner.model.cuda_graph_buckets,
                          "routed": engine.num_requests_routed, "free": free,
                          "layouts": read_dp_layouts(layout_dir, 2)}), flush=True)
    finally:
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
