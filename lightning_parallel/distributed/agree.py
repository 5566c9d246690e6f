"""The one place where ranks agree: one rank's failure becomes every rank's failure, or all go on.

A rank that raises while its peers enter a collective leaves them waiting until the process-group
timeout (30 minutes by default). Every decision that some ranks could take and others not goes through
the primitives here instead: each rank brings its error (or ``None``) to :func:`agree`, and either
every rank raises the same error or every rank goes on. :func:`decide_on` runs a function on one rank
and hands its result, or its error, to every rank. Pure PyTorch (no Lightning import).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "PostedVote",
    "agree",
    "collective_device",
    "decide_on",
    "distributed_ready",
    "failing_together",
    "packed_error",
    "unpacked_error",
]

T = TypeVar("T")


def distributed_ready() -> bool:
    """Whether ``torch.distributed`` is available and initialised (collectives are no-ops otherwise)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any | None = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if distributed_ready() else 1


def collective_device(group: Any | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: this rank's GPU under NCCL, else the CPU."""
    if distributed_ready() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(error: BaseException | None, group: Any | None = None) -> None:
    """Raise on every rank of ``group`` if any rank brings an error; return on every rank otherwise.

    Call it on every rank of ``group`` at the same point. It costs one ``all_reduce`` of one number when
    nobody failed; when some rank failed, the errors travel in one more object gather and every rank
    raises: a rank that failed raises its own error, the others raise a copy of the error of the
    lowest failing rank, with a note naming that rank.

    Example::

        error = None
        try:
            prepare_this_rank()
        except Exception as err:
            error = err
        agree(error)          # all ranks raise together, or all go on to the next collective
    """
    if world_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    errors: list[Any] = [None] * world_size(group)
    dist.all_gather_object(errors, packed_error(error), group=group)
    if error is not None:
        raise error
    raise unpacked_error(next(e for e in errors if e[1] is not None))


def decide_on(src: int, fn: Callable[[], T], group: Any | None = None) -> T:
    """Run ``fn`` on global rank ``src`` only; every rank of ``group`` returns its result or raises its error.

    Example::

        costs = decide_on(0, lambda: measure_layers(model, batch))   # measured once, the same everywhere
    """
    result: Any = None
    error: BaseException | None = None
    is_src = not distributed_ready() or dist.get_rank() == src
    if is_src:
        try:
            result = fn()
        except Exception as err:
            error = err
    agree(error, group)
    if world_size(group) == 1:
        return result
    box = [result]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class PostedVote:
    """The highest flag (or code) any rank of ``group`` posted: posted now (asynchronously), read later.

    Off the critical path: every rank posts it at the same point (a MAX all-reduce of one number) and
    reads it at a later point, by when every rank has long joined it, so no rank waits for the slowest.
    A flag (``True``/``False``) reads back as 1 or 0; a code (a signal's number) as the highest posted.

    Example::

        vote = PostedVote(stopped_here)      # at a batch's start, on every rank
        ...
        if vote.result():                    # at the next batch: the same answer on every rank
            stop()
    """

    def __init__(self, value: bool | int, group: Any | None = None) -> None:
        self._flag = torch.tensor([int(value)], device=collective_device(group))
        self._work = None
        if world_size(group) > 1:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result(self) -> int:
        """Wait for the vote (every rank posted it); the highest value posted (0: no flag raised)."""
        if self._work is not None:
            self._work.wait()
        return int(self._flag.item())


@contextmanager
def failing_together(group: Any | None = None) -> Iterator[None]:
    """Run the block on every rank of ``group``; if it raises on any rank, it raises on every rank.

    Example::

        with failing_together():
            layout = read_loader_layout(trainer)     # may raise on one rank only
        gathered = all_gather(layout)                # reached by every rank, or by none
    """
    try:
        yield
    except Exception as err:
        agree(err, group)
        raise
    agree(None, group)


def packed_error(error: BaseException | None) -> tuple[int, Any]:
    """``(this global rank, the error as it can travel)``: the exception itself if it pickles, else its text.

    For a channel that already carries something from one rank to the others (a record broadcast) and
    can carry an error in its place; :func:`unpacked_error` turns it back into an exception to raise.

    Example::

        box = [packed_error(err)]
        dist.broadcast_object_list(box, src=src)
        raise unpacked_error(box[0])     # on every rank: the same error, noting where it was raised
    """
    rank = dist.get_rank() if distributed_ready() else 0
    if error is None:
        return rank, None
    try:
        pickle.loads(pickle.dumps(error))
        return rank, error
    except Exception:
        return rank, f"{type(error).__name__}: {error}"


def unpacked_error(packed: tuple[int, Any]) -> BaseException:
    """A copy of a :func:`packed_error`'s exception, with a note naming the rank that raised it."""
    rank, error = packed
    if isinstance(error, BaseException):
        error = copy.copy(error)
        error.__traceback__ = None
    else:
        error = RuntimeError(error)
    note = f"raised on global rank {rank}; this rank stops with it"
    if hasattr(error, "add_note"):
        error.add_note(note)
    return error
