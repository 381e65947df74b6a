"""The full-batch decode window (`bench compare --decode-window`): when it opens and closes, and an arm
that stops once it is measured, with the window as its headline."""

from __future__ import annotations

import pytest

from fxrewrite.benchmarks.decode_window import DecodeWindow


def test_window_opens_after_every_prefill_and_closes_at_its_length():
    w = DecodeWindow(2)
    assert not w.update(1.0, {"a": 1, "b": 0}, 0)  # b still in prefill: not open
    assert not w.update(2.0, {"a": 2, "b": 1}, 0) and w.start == (2.0, 3)
    assert not w.update(2.5, {"a": 3, "b": 2}, 0)
    assert w.update(3.0, {"a": 4, "b": 3}, 0)
    assert w.result() == {"steps": 2, "batch": 2, "output_tokens": 4, "seconds": 1.0, "output_tokens_per_s": 4.0}


def test_window_closes_at_the_first_finished_request_and_reports_a_run_cut_in_prefill():
    w = DecodeWindow(10)
    w.update(1.0, {"a": 1, "b": 1}, 0)
    assert w.update(2.0, {"a": 2, "b": 2}, 1)  # the finishing step still decoded both: counted
    assert w.result()["steps"] == 1 and w.result()["output_tokens_per_s"] == 2.0
    cut = DecodeWindow(3)
    cut.update(1.0, {"a": 1, "b": 0}, 0)
    assert cut.result()["output_tokens_per_s"] is None and "prefill" in cut.result()["reason"]
    with pytest.raises(ValueError, match="steps=0"):
        DecodeWindow(0)


def test_compare_with_a_decode_window_stops_each_arm_and_uses_it_as_headline(tmp_path):
    import torch

    from fxrewrite.benchmarks.compare import compare

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = compare("tiny", ["native"], "throughput", num_prompts=3, out_dir=tmp_path, isolate=False,
                         workload_overrides=dict(min_len=4, max_input_len=12, max_output_len=40,
                                                 decode_window_steps=2),
                         engine_kwargs={"max_num_seqs": 4, "kv_cache_memory_bytes": 1 << 22, "device": "cpu"},
                         config_overrides={"num_hidden_layers": 1})
    finally:
        torch.set_num_threads(threads)
    arm = result["arms"]["native"]
    assert "error" not in arm, arm.get("traceback")
    window = arm["decode_window"]
    assert window["steps"] == 2 and window["batch"] == 3 and window["output_tokens"] > 0
    assert arm["truncated"] and arm["num_finished"] == 0 and arm["headline_key"] == "decode_window.output_tokens_per_s"
    assert result["name"].endswith("throughput-decode-window2")
    assert result["workload"]["decode_window_steps"] == 2


def test_cli_rejects_a_decode_window_outside_the_throughput_workload(capsys):
    from fxrewrite.cli import main

    assert main(["bench", "compare", "--config", "tiny", "--workload", "latency", "--decode-window", "4"]) == 2
    assert "--decode-window" in capsys.readouterr().err
