"""vLLM's `abort_request(list_of_ids)` (one id still works), and a worker's result sender that exits past a send
nobody will read (a `-dp 2` server stopped with requests in flight took 13 s: the workers waited on their last
step's tokens until the driver killed them)."""

from __future__ import annotations

import threading
import time

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.llm import LLM
from fxrewrite.runtime.worker.worker import CLOSE_WAIT_S, ResultSender


def test_abort_request_takes_a_list_of_ids(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3")), dtype="float32", kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    engine.step()
    assert engine.block_manager.num_free_blocks < free
    engine.abort_request(["a", "b", "unknown"])
    engine.abort_request("c")
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free


class _BlockedChannel:
    def __init__(self):
        self.release = threading.Event()

    def send_result(self, payload):
        self.release.wait()  # a driver that never receives


def test_result_sender_close_does_not_wait_for_an_unread_send():
    channel = _BlockedChannel()
    sender = ResultSender(channel, "cpu")
    sender.reply("tokens nobody reads")
    start = time.monotonic()
    sender.close()
    assert time.monotonic() - start < CLOSE_WAIT_S + 2.0
    channel.release.set()
