"""Broadcast a small record of numbers from one rank, in one tensor collective once its layout is known.

A pipeline's last stage sends every training step's loss and logged values to the other stages of its
replica. ``broadcast_object_list`` would pickle them and make two collectives per step. Here the
record's *layout* (its names and options) travels as an object only when it changes; in the steady
state the numbers travel alone, in one broadcast of a fixed-size float64 vector. An error on ``src``
travels in the record's place (the object path), and every rank raises it.
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

    def broadcast(
        self, record: tuple[Any, Sequence[float]] | None, error: BaseException | None = None
    ) -> tuple[Any, list[float]]:
        if world_size(self.group) == 1:
            if error is not None:
                raise error
            assert record is not None
            return record[0], list(record[1])
        vec = torch.zeros(_HEADER + self.capacity, dtype=torch.float64)
        if error is not None:
            vec[0] = _ERROR
        elif record is not None:
            layout, values = record
            changed = layout != self.layout or len(values) > self.capacity
            vec[0], vec[1] = float(changed), float(len(values))
            if not changed:
                vec[_HEADER : _HEADER + len(values)] = torch.tensor(list(values), dtype=torch.float64)
        device = collective_device(self.group)
        vec = vec.to(device)
        dist.broadcast(vec, src=self.src, group=self.group)
        vec = vec.cpu()
        if vec[0].item() == _ERROR:
            box = [packed_error(error)]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            raise error if error is not None else unpacked_error(box[0])
        if vec[0].item():
            box = [record]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            layout, values = box[0]
            self.layout, self.capacity = layout, max(16, 2 * len(values))
            self.object_broadcasts += 1
            return layout, list(values)
        return self.layout, vec[_HEADER : _HEADER + int(vec[1].item())].tolist()
