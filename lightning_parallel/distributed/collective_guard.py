"""Collectives a block may issue: those whose ranks all run the block; any other is refused at its call.

Under a pipeline only some ranks run a given piece of user code: the user's step runs on the last stage
(and up to the model call on the first). A ``torch.distributed`` collective there over the default
(world) group waits forever for ranks that never reach it. While :func:`collectives_limited_to` is
active, each collective function of ``torch.distributed`` looks at its group first: if every rank of
the group runs the block, the call goes through; otherwise ``refused(name)`` decides instead (raise an
error that names the call and the fix, or stand in for it). Pure PyTorch, no Lightning.

The functions are replaced in ``torch.distributed`` (and ``distributed_c10d``) only for the block's
duration, and act only on the calling thread; whatever was there before (the HangWatchdog's wrappers)
is put back as it was.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_parallel.distributed.watchdog_state import COLLECTIVES

__all__ = ["collectives_limited_to", "group_ranks"]

_MODULES = (dist, c10d)


def group_ranks(group: Any | None) -> frozenset[int]:
    """The global ranks of ``group`` (``None`` or ``WORLD``: every rank)."""
    if group is None or group is dist.group.WORLD:
        return frozenset(range(dist.get_world_size()))
    return frozenset(dist.get_process_group_ranks(group))


@contextmanager
def collectives_limited_to(ranks: frozenset[int], refused: Callable[[str], Any]) -> Iterator[None]:
    """Inside the block, a collective whose group reaches beyond ``ranks`` calls ``refused(name)`` instead.

    ``refused`` may raise (the usual case) or return what the call returns in its place.

    Example::

        def refuse(name):
            raise RuntimeError(f"torch.distributed.{name} over ranks that do not run this step ...")

        with collectives_limited_to(frozenset({2, 3}), refuse):
            dist.all_reduce(t, group=last_stage_replicas)   # ranks 2, 3: goes through
            dist.all_reduce(t)                              # the world: refuse("all_reduce")
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    saved: list[tuple[Any, str, Any]] = []
    for name in COLLECTIVES:
        for module in _MODULES:
            current = getattr(module, name, None)
            if callable(current):
                saved.append((module, name, current))
                setattr(module, name, _limited(name, current))
    previous, _LIMITS.active = getattr(_LIMITS, "active", None), (ranks, refused)
    try:
        yield
    finally:
        _LIMITS.active = previous
        for module, name, current in reversed(saved):
            setattr(module, name, current)


_LIMITS = threading.local()  # .active: (ranks, refused) inside a block on this thread, else None
_WRAPPERS: dict[Callable, Callable] = {}  # one wrapper per function, made once (its signature read once)


def _limited(name: str, original: Callable) -> Callable:
    wrapper = _WRAPPERS.get(original)
    if wrapper is not None:
        return wrapper
    group_of = _group_argument(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        active = getattr(_LIMITS, "active", None)  # another thread's calls go through
        if active is None or group_ranks(group_of(args, kwargs)) <= active[0]:
            return original(*args, **kwargs)
        return active[1](name)

    _WRAPPERS[original] = call
    return call


def _group_argument(fn: Callable) -> Callable[[tuple, dict], Any]:
    """How to read the ``group`` a call passes (by keyword or position; ``None`` when left out)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    index = params.index("group") if "group" in params else None

    def group_of(args: tuple, kwargs: dict) -> Any:
        if "group" in kwargs:
            return kwargs["group"]
        return args[index] if index is not None and index < len(args) else None

    return group_of
