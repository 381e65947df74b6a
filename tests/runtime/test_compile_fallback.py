"""Only compile failures fall back to eager, once and loudly; an OOM or a bug is raised (issue 15 item 12)."""

import logging

import pytest
import torch
from torch import nn

from fxrewrite.runtime.worker.compilation import forward_or_fallback, is_compile_failure


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids, positions):
        return self.embed(input_ids) + positions[:, None]


def _failing_backend(gm, example_inputs):
    raise RuntimeError("backend cannot compile this")


def _compiled(forward):
    model = _Tiny()
    model.forward = forward(model)
    model._fxrewrite_compiled = True
    return model


def _inputs():
    return torch.tensor([1, 2, 3]), torch.arange(3.0)


def test_backend_failure_falls_back_once_and_logs_an_error(caplog):
    model = _compiled(lambda m: torch.compile(m.forward, backend=_failing_backend))
    ids, pos = _inputs()
    with caplog.at_level(logging.WARNING, logger="fxrewrite.runtime.worker.compilation"):
        out = forward_or_fallback(model, ids, pos)
        again = forward_or_fallback(model, ids, pos)
    eager = _Tiny.forward(model, ids, pos)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(again, eager)
    records = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert "BackendCompilerFailed" in records[0].getMessage()
    assert not model._fxrewrite_compiled and "forward" not in model.__dict__


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), ValueError("a bug in a kernel"),
                                   IndexError("index 9 is out of bounds")])
def test_other_errors_are_raised_and_the_compiled_forward_kept(error, caplog):
    def raising(m):
        def forward(input_ids, positions):
            raise error
        return forward
    model = _compiled(raising)
    with caplog.at_level(logging.WARNING), pytest.raises(type(error)):
        forward_or_fallback(model, *_inputs())
    assert model._fxrewrite_compiled and "forward" in model.__dict__
    assert not caplog.records


def _oom_backend(gm, example_inputs):
    raise torch.OutOfMemoryError("CUDA out of memory while autotuning")


def test_an_oom_inside_a_compile_failure_is_still_an_oom():
    model = _compiled(lambda m: torch.compile(m.forward, backend=_oom_backend))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:  # dynamo's wrapper around the OOM
        forward_or_fallback(model, *_inputs())
    assert not is_compile_failure(info.value)
    assert model._fxrewrite_compiled and "forward" in model.__dict__
    assert not is_compile_failure(RuntimeError("x"))
