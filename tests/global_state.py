"""The global state a test may not leave changed: the suite's cheap guard against order dependence.

A test that patches ``torch.distributed`` (the watchdog, the collective guard), torch's pipeline
schedule (the timeline's hooks) or torch's global flags and does not restore them changes every test
that runs after it: the suite then passes or fails by order, and a file passes alone but not after
another. conftest.py takes a :func:`snapshot` before each test and fails the test whose end differs,
naming what changed. Only modules already imported are looked at (a module not imported yet cannot
have been patched), so the guard imports nothing; it costs well under a millisecond per test.

Example::

    before = snapshot()
    ...                                   # the test
    assert changes(before, snapshot()) == []
"""

from __future__ import annotations

import sys
from typing import Any

import torch

# module (or "module:Class") -> its attributes that the package's patches replace.
_PATCHED = (
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.pipelining.schedules",
    "torch.distributed.pipelining.stage:_PipelineStageBase",
)


def _namespace(where: str) -> dict[str, Any] | None:
    module_name, _, class_name = where.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        return None
    owner = getattr(module, class_name) if class_name else module
    return {name: value for name, value in vars(owner).items() if callable(value)}


def snapshot() -> dict[str, Any]:
    """The functions of the patched modules (by identity) and torch's global flags, as they are now."""
    state: dict[str, Any] = {where: _namespace(where) for where in _PATCHED}
    state["torch flags"] = {
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
    }
    return state


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs, one line each: ``torch.distributed.barrier: <function f> (was <function barrier>)``."""
    found = []
    for where, old in before.items():
        new = after.get(where)
        if old is None or new is None:  # imported during the test: nothing to compare with
            continue
        for name, value in old.items():  # replaced or removed (an import may add names: not a patch)
            if new.get(name) is not value and new.get(name) != value:
                found.append(f"{where}.{name}: {new.get(name)!r} (was {value!r})")
    return found
