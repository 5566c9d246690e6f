"""What failed when a forward could not be traced and split: the model's forward, or this package.

The traced path runs several steps: torch.export of the twin's forward, then this package's (and
torch's) steps on the exported graph: splitting it into stages, relaying values past stages, building
the stages. Each step's failure is caught as a :class:`TraceStepFailed` naming it. An export failure
is checked against ``torch.export.export`` of the user's module on the real input: when that fails
too, the forward cannot be exported, and the message gives torch's reason, the line of the user's
code and the two ways out; when it succeeds, or another step failed, the failure is this package's
and the message says so and asks for a bug report.
"""

from __future__ import annotations

import contextlib
import os
import re
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

EXPORT = "exporting forward with torch.export"
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])


class PipelineTraceError(RuntimeError):
    """A forward could not be traced and split; the message says which step failed and what to do."""


class TraceStepFailed(RuntimeError):
    """One step of the traced path failed (``step``); its error is the ``__cause__``."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(f"{step}: {type(error).__name__}: {error}")
        self.step, self.error = step, error

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its two arguments: a failure on the rank that exports for the others travels
        # to them as itself (distributed/agree.py pickles it).
        return (TraceStepFailed, (self.step, self.error))


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Raise any failure inside as :class:`TraceStepFailed` of step ``name`` (an inner step's stays).

    Example::

        with step("splitting the exported graph"):
            pipe = Pipe._from_traced(...)
    """
    try:
        yield
    except (TraceStepFailed, PipelineTraceError):
        raise
    except Exception as err:
        raise TraceStepFailed(name, err) from err


def export_check(module: nn.Module, args: tuple[Any, ...], bound: Callable[[], Any]) -> BaseException | None:
    """``torch.export.export`` of ``module`` on ``args`` (moved to its device) inside ``bound()``: its
    error, or ``None`` when it succeeds. Export fakes the tensors itself: nothing is allocated."""
    device = next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))
    args = tuple(a.to(device) if torch.is_tensor(a) else a for a in args)
    try:
        with bound():
            torch.export.export(module, args)
    except Exception as err:
        return err
    return None


def explain(
    failed: TraceStepFailed,
    what: str,
    check: Callable[[], BaseException | None] | None = None,
    note: str = "",
) -> PipelineTraceError:
    """The error to raise for a failed step of tracing ``what`` (``"GPT.forward"``).

    ``check`` runs :func:`export_check` on the user's module (where this rank still holds all of it);
    without it, an export failure is reported as the forward's, with ``note`` saying why it was not
    checked.
    """
    if failed.step != EXPORT:
        return ours(failed, what, exported=True)
    real = check() if check is not None else failed.error
    if real is None:
        return ours(failed, what, exported=True, real_export_ok=True)
    checked = (
        "torch.export.export of the module on this batch fails the same way"
        if check is not None
        else note or "not checked against the module itself"
    )
    return PipelineTraceError(
        f"PipelineStrategy could not trace {what} with torch.export{_at(real)}: {checked}. torch.export "
        f"reported:\n    {_reported(real)}\nTwo ways out: make forward exportable (no Python branches on "
        f"tensor values: use torch.where / torch.cond; see https://pytorch.org/docs/stable/export.html), "
        f"or hold the layers in a top-level nn.Sequential, which PipelineStrategy splits without tracing"
    )


def ours(
    failed: TraceStepFailed, what: str, exported: bool, real_export_ok: bool = False
) -> PipelineTraceError:
    """A failure of this package's own step: said plainly, the step named, a bug report asked for."""
    if real_export_ok:
        fact = (
            f"torch.export.export of the module on this batch succeeds, so {what} needs no change: "
            f"PipelineStrategy's export of its twin (fake tensors of the stage's device) failed"
        )
    else:
        fact = f"torch.export captured {what}, so the model needs no change"
    return PipelineTraceError(
        f"PipelineStrategy failed in its own step `{failed.step}` ({fact}). This is a bug in "
        f"lightning_parallel: please report it, with this message and the model's code. The step "
        f"failed with:\n    "
        f"{_reported(failed.error)}\nUntil it is fixed, a model whose layers are held in a top-level "
        f"nn.Sequential is split without tracing"
    )


def user_line(err: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the user's code in ``err``'s traceback (or its text).

    The user's code is any file but torch's, this package's, Python's own and generated code; a
    third-party model library counts as the user's (its line is the one to look at).
    """
    frames: list[tuple[str, int]] = []
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames += [(f.filename, f.lineno or 0) for f in traceback.extract_tb(current.__traceback__)]
        frames += [(f, int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', str(current))]
        current = current.__cause__ or current.__context__
    users = [f"{f}:{n}" for f, n in frames if _is_users(f)]
    return users[-1] if users else None


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <eval_with_key>, <frozen ...>, <string>
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(root + os.sep) for root in (_TORCH, _OURS, _STDLIB))


def _at(err: BaseException) -> str:
    line = user_line(err)
    return f", at {line}" if line else ""


def _reported(err: BaseException) -> str:
    text = str(err).strip()
    lines = text.splitlines()
    body = "\n    ".join(lines[:12]) + ("\n    ..." if len(lines) > 12 else "")
    return f"{type(err).__name__}: {body}"
