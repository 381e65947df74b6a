"""Benchmarks: before/after/native/hf comparisons (`compare.py`) and kernel timings (`kernels.py`)."""
