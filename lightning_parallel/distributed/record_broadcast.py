"""Broadcast a small record of numbers from one rank, in one tensor collective once its layout is known.

A pipeline's last stage sends every training step's loss and logged values to the other stages of its
replica. ``broadcast_object_list`` would pickle them and make two collectives per step. Here the
record's *layout* (its names and options) travels as an object only when it changes; in the steady
state the numbers travel alone, in one broadcast of a fixed-size float64 vector. An error on ``src``
travels in the record's place (the object path), and every rank raises it.

Off the critical path: the sender does not wait for its broadcast to arrive (it completes when the
receivers join, and is waited for at the next call), and a receiver may post its receive ahead
(:meth:`RecordBroadcast.post`, before the pipeline's schedule runs), so the numbers are already there
when it asks. A pipeline's last stage ends its schedule before the first stage ends the drain: it goes
on to its optimizer step instead of waiting for the first stage in the broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.agree import (
    collective_device,
    packed_error,
    unpacked_error,
    world_size,
)

_HEADER = 2  # [layout changed (1.0), unchanged (0.0) or an error instead (2.0), number of values]
_ERROR = 2.0


class RecordBroadcast:
    """Send ``(layout, values)`` from global rank ``src`` to every rank of ``group``.

    ``layout`` is any picklable object that describes the values (compared with ``==``); ``values``
    is a sequence of floats. Every rank calls :meth:`broadcast` at the same point; ``src`` passes its
    record, the others pass ``None``, and every rank gets the record back. ``src`` may pass an
    ``error`` instead of a record: every rank raises it (``src`` its own, the others a copy that names
    ``src``), so a failure on ``src`` stops every rank at the same point instead of leaving them waiting.

    Example::

        channel = RecordBroadcast(src=last_stage_rank, group=pp_group)
        layout, values = channel.broadcast((("train_loss",), [0.25]) if is_last else None)
        channel.broadcast(None, error=err)      # on src: every rank of the group raises err
    """

    def __init__(self, src: int, group: Any | None = None) -> None:
        self.src, self.group = src, group
        self.layout: Any = None
        self.capacity = 0
        self.object_broadcasts = 0  # how often the layout had to travel (tests and benchmarks read it)
        self._pending: tuple[torch.Tensor, Any] | None = None  # a broadcast posted, not yet waited for

    def post(self) -> None:
        """On a receiving rank: post the next broadcast's receive now; :meth:`broadcast` then completes it.

        Every rank of ``group`` still calls :meth:`broadcast` next, and nothing else on ``group`` in
        between (the receive is a collective of ``group``, ordered with its others). A no-op on ``src``,
        without a process group, when one is posted already, and on backends other than gloo.
        """
        if self._pending is not None or world_size(self.group) == 1 or dist.get_rank() == self.src:
            return
        if dist.get_backend(self.group) != "gloo":
            # NCCL runs a communicator's operations in order on one stream, and a 2-rank group's
            # point-to-point sends share that communicator: a broadcast posted before the schedule
            # would hold back the schedule's own sends and receives, which the sender needs before
            # it broadcasts. Gloo matches collectives and point-to-point messages apart.
            return
        vec = self._empty()
        self._pending = (vec, dist.broadcast(vec, src=self.src, group=self.group, async_op=True))

    def _empty(self) -> torch.Tensor:
        return torch.zeros(_HEADER + self.capacity, dtype=torch.float64, device=collective_device(self.group))

    def _finish_pending(self) -> torch.Tensor | None:
        """Wait for the broadcast posted (or, on ``src``, sent) before; its vector, or None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending[1].wait()
        return pending[0]

    def broadcast(
        self, record: tuple[Any, Sequence[float]] | None, error: BaseException | None = None
    ) -> tuple[Any, list[float]]:
        if world_size(self.group) == 1:
            if error is not None:
                raise error
            assert record is not None
            return record[0], list(record[1])
        if error is not None:  # the sender, failing: the marker, then the error as an object
            self._finish_pending()
            vec = self._empty()
            vec[0] = _ERROR
            dist.broadcast(vec, src=self.src, group=self.group)
            dist.broadcast_object_list([packed_error(error)], src=self.src, group=self.group)
            raise error
        if record is not None:  # the sender: its previous send has long arrived
            self._finish_pending()
            return self._send(*record)
        vec = self._finish_pending()  # the receive posted ahead, if any
        if vec is None:
            vec = self._empty()
            dist.broadcast(vec, src=self.src, group=self.group)
        vec = vec.cpu()
        if vec[0].item() == _ERROR:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            raise unpacked_error(box[0])
        if vec[0].item():
            return self._new_layout(None)
        return self.layout, vec[_HEADER : _HEADER + int(vec[1].item())].tolist()

    def _send(self, layout: Any, values: Sequence[float]) -> tuple[Any, list[float]]:
        changed = layout != self.layout or len(values) > self.capacity
        vec = torch.zeros(_HEADER + self.capacity, dtype=torch.float64)
        vec[0], vec[1] = float(changed), float(len(values))
        if not changed:
            vec[_HEADER : _HEADER + len(values)] = torch.tensor(list(values), dtype=torch.float64)
        vec = vec.to(collective_device(self.group))
        work = dist.broadcast(vec, src=self.src, group=self.group, async_op=True)
        if changed:
            work.wait()
            return self._new_layout((layout, values))
        self._pending = (vec, work)  # waited for at the next call: the receivers take it meanwhile
        return layout, list(values)

    def _new_layout(self, record: tuple[Any, Sequence[float]] | None) -> tuple[Any, list[float]]:
        box = [record]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        layout, values = box[0]
        self.layout, self.capacity = layout, max(16, 2 * len(values))
        self.object_broadcasts += 1
        return layout, list(values)
