"""The GPU-idle attribution of `benchmarks/train_gaps.py` on a hand-made profiler trace (the tool itself needs a GPU)."""

from __future__ import annotations

from fxrewrite.benchmarks.train_gaps import gaps_by_call_site


def _x(cat, ts, dur, **extra):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, **extra}


def test_gaps_are_keyed_by_the_launching_call_site():
    trace = {"traceEvents": [
        _x("kernel", 0, 10, args={"correlation": 1}),
        _x("kernel", 12, 10, args={"correlation": 2}),  # 2 us after the first: under the threshold
        _x("kernel", 100, 10, args={"correlation": 3}),  # 78 us idle before it, launched by the runtime API
        _x("kernel", 300, 10, args={"correlation": 4}),  # 190 us idle, a driver-API (Triton) launch
        _x("cuda_runtime", 95, 2, tid=7, name="cudaLaunchKernel", args={"correlation": 3}),
        _x("cuda_driver", 290, 2, tid=7, name="cuLaunchKernelEx", args={"correlation": 4}),
        _x("python_function", 30, 90, tid=7, name="transformers/models/llama/modeling_llama.py(60): forward"),
        _x("python_function", 40, 80, tid=7, name="torch/nn/modules/module.py(1779): _call_impl"),
        _x("python_function", 50, 60, tid=7, name="/repo/kernels/rms_norm.py(12): rms_norm"),
        _x("python_function", 280, 20, tid=7, name="/repo/kernels/activation.py(77): _act_and_mul_triton"),
        _x("python_function", 285, 10, tid=7, name="triton/runtime/jit.py(695): run"),
    ]}
    got = gaps_by_call_site(trace, min_gap_us=20)
    assert got["busy_ms"] == 0.04 and got["idle_ms"] == 0.27 and got["span_ms"] == 0.31
    assert got["gaps"] == [["activation.py:77 _act_and_mul_triton", 0.19, 1],
                           ["rms_norm.py:12 rms_norm < modeling_llama.py:60 forward", 0.08, 1]]
