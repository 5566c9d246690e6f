"""sources/traced/errors.py: a failed trace says whose failure it is (the forward's, or this package's)."""

import contextlib

import pytest
import torch
from torch import nn

from lightning_parallel.sources.traced.errors import (
    EXPORT,
    PipelineTraceError,
    TraceStepFailed,
    explain,
    export_check,
    step,
    user_line,
)


class BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # a Python branch on a tensor value: torch.export cannot capture it
            return self.lin(x)
        return -self.lin(x)


def _failed(name: str, fn) -> TraceStepFailed:
    with pytest.raises(TraceStepFailed) as info, step(name):
        fn()
    return info.value


def test_a_step_names_itself_and_an_inner_step_wins():
    failed = _failed("splitting", lambda: 1 / 0)
    assert failed.step == "splitting" and isinstance(failed.error, ZeroDivisionError)
    with pytest.raises(TraceStepFailed) as info, step("outer"), step("inner"):
        raise ValueError("x")
    assert info.value.step == "inner"


def test_the_users_line_is_the_innermost_frame_outside_torch_and_this_package():
    err = export_check(BranchesOnValues(), (torch.ones(2, 4),), contextlib.nullcontext)
    assert err is not None
    line = user_line(err)
    assert line is not None and line.startswith(__file__) and int(line.rsplit(":", 1)[1]) > 0
    assert user_line(ValueError("no traceback")) is None


def test_an_export_failure_checked_against_the_real_module_is_the_forwards():
    model, args = BranchesOnValues(), (torch.ones(2, 4),)
    failed = TraceStepFailed(EXPORT, RuntimeError("whatever the twin said"))
    error = explain(
        failed, "BranchesOnValues.forward", check=lambda: export_check(model, args, contextlib.nullcontext)
    )
    message = str(error)
    assert isinstance(error, PipelineTraceError)
    assert "could not trace BranchesOnValues.forward with torch.export, at " in message
    assert "test_trace_errors.py:" in message and "fails the same way" in message
    assert "data-dependent" in message or "GuardOnDataDependent" in message  # torch's own reason
    assert "make forward exportable" in message and "top-level nn.Sequential" in message


def test_an_export_failure_the_real_module_does_not_have_is_this_packages():
    model, args = nn.Linear(4, 4), (torch.ones(2, 4),)
    failed = TraceStepFailed(EXPORT, RuntimeError("the twin's export broke"))
    message = str(
        explain(failed, "Linear.forward", check=lambda: export_check(model, args, contextlib.nullcontext))
    )
    assert "failed in its own step `exporting forward with torch.export`" in message
    assert "torch.export.export of the module on this batch succeeds" in message
    assert "bug in lightning_parallel: please report it" in message and "the twin's export broke" in message
    assert "make forward exportable" not in message


def test_a_failure_after_export_is_this_packages_and_names_the_step():
    failed = _failed("relaying values read past the next stage", lambda: (_ for _ in ()).throw(KeyError("x")))
    message = str(explain(failed, "GPT.forward"))
    assert message.startswith(
        "PipelineStrategy failed in its own step `relaying values read past the next stage`"
    )
    assert "torch.export captured GPT.forward, so the model needs no change" in message
    assert (
        "please report it" in message and "KeyError" in message and "make forward exportable" not in message
    )


def test_an_unchecked_export_failure_says_why_it_was_not_checked():
    failed = TraceStepFailed(EXPORT, RuntimeError("Could not guard on data-dependent expression"))
    message = str(explain(failed, "GPT.forward", note="the module is on the meta device"))
    assert "torch.export: the module is on the meta device. torch.export reported" in message
    assert "Could not guard" in message
    assert "make forward exportable" in message
