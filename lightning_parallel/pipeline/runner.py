"""Drive torch.distributed.pipelining: one PipelineStage set and schedule per input shape, cached.

A schedule fixes its activation shapes at its first step (torch 2.13: a later batch of another size
fails and takes the peer rank down), so each distinct batch shape, micro-batch count and mode
(train / forward-only) gets its own stages and schedule, built on first use on every rank alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    ScheduleGPipe,
    get_schedule_class,
)

SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
)


def schedule_class(name: str) -> type:
    """The torch schedule class for one of :data:`SCHEDULES` (snake_case names)."""
    if not isinstance(name, str) or name.lower() not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return get_schedule_class(name.lower().replace("_", ""))


def is_multi_stage(cls: type) -> bool:
    """Whether the schedule runs several stages per rank (interleaved/looped)."""
    return issubclass(cls, PipelineScheduleMulti)


class PipelineRunner:
    """This rank's stages and the cached schedules that run them.

    Args:
        stage_modules: this rank's stage modules, in stage order.
        stage_indices: their global stage indices.
        num_stages: stages in the whole pipeline.
        device: where the stage modules live.
        group: the pipeline process group (the stages of one replica).
        schedule: a name from :data:`SCHEDULES`.
        num_microbatches: micro-batches per batch (fewer for a batch it does not divide).

    Example::

        runner = PipelineRunner([stage_mod], [rank], 2, torch.device("cpu"), pp_group, "1f1b", 4)
        runner.train_step(key, m, args_or_none, loss_fn)   # forward + backward of every micro-batch
    """

    max_cached = 8

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        stage_indices: Sequence[int],
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        schedule: str,
        num_microbatches: int,
    ) -> None:
        self.stage_modules = list(stage_modules)
        self.stage_indices = list(stage_indices)
        self.num_stages = num_stages
        self.device = device
        self.group = group
        self.schedule_cls = schedule_class(schedule)
        self.num_microbatches = num_microbatches
        self.has_first = 0 in self.stage_indices
        self.has_last = num_stages - 1 in self.stage_indices
        self._cache: OrderedDict[Hashable, Any] = OrderedDict()
        self._loss_fn: Callable[[Any, int], torch.Tensor] | None = None
        self._metadata_call_pending = False
        self._seen: list[int] = []

    def clear(self) -> None:
        """Drop every cached stage and schedule (they hold process-group state and buffers)."""
        self._cache.clear()

    def microbatches_for(self, batch_size: int) -> int:
        """The micro-batch count for a batch: the largest divisor of its size up to num_microbatches.

        Equal micro-batches keep the schedule's buffers valid; the loss weighting keeps the mean exact.
        """
        if batch_size < 1:
            raise ValueError("PipelineStrategy received an empty batch")
        m = min(self.num_microbatches, batch_size)
        while batch_size % m:
            m -= 1
        return m

    def train_step(
        self,
        key: Hashable,
        num_microbatches: int,
        args: tuple[Any, ...] | None,
        loss_fn: Callable[[Any, int], torch.Tensor],
    ) -> None:
        """Forward and backward of every micro-batch; ``loss_fn(output_chunk, index)`` on the last stage."""
        cache_key = ("train", key, num_microbatches)
        # torch 2.13 infers a new stage's metadata at its first step by calling loss_fn once on a
        # dummy output of micro-batch 0, before the real micro-batches: that call must not reach
        # the user's training_step (it would log or update metrics with garbage).
        self._metadata_call_pending = self.has_last and cache_key not in self._cache
        schedule = self._schedule(cache_key, num_microbatches, train=True)
        target = torch.arange(num_microbatches) if self.has_last else None
        self._loss_fn, self._seen = loss_fn, []
        try:
            schedule.step(*(args if self.has_first else ()), target=target)
        finally:
            self._loss_fn = None
        if self.has_last and sorted(self._seen) != list(range(num_microbatches)):
            raise RuntimeError(
                f"the pipeline schedule computed the loss of micro-batches {self._seen}, expected each of "
                f"0..{num_microbatches - 1} once: torch.distributed.pipelining changed how it calls loss_fn "
                f"(checked against torch 2.13)"
            )

    def forward(self, key: Hashable, num_microbatches: int, args: tuple[Any, ...] | None) -> Any:
        """Forward only; returns the merged output of the whole batch on the last stage, else None."""
        schedule = self._schedule(("eval", key, num_microbatches), num_microbatches, train=False)
        return schedule.step(*(args if self.has_first else ()))

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        # The schedule splits `target` = arange(m) into one index per micro-batch.
        assert self._loss_fn is not None
        if self._metadata_call_pending:
            self._metadata_call_pending = False
            return _metadata_loss(output)
        self._seen.append(int(index.item()))
        return self._loss_fn(output, self._seen[-1])

    def _schedule(self, key: Hashable, num_microbatches: int, train: bool) -> Any:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        stages = [
            PipelineStage(module, index, self.num_stages, self.device, group=self.group)
            for module, index in zip(self.stage_modules, self.stage_indices)
        ]
        loss_fn = self._loss if train else None
        cls = self.schedule_cls
        if not is_multi_stage(cls) and num_microbatches < self.num_stages and cls is not ScheduleGPipe:
            # 1F1B needs at least one micro-batch per stage; a short batch falls back to GPipe,
            # which runs the same stages in the same order of micro-batches.
            cls = ScheduleGPipe
        target = stages if is_multi_stage(cls) else stages[0]
        # scale_grads=False: the loss is scaled instead (see the strategy); torch's default divides
        # every .grad by m after each step, which breaks gradient accumulation across steps.
        schedule = cls(target, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        self._cache[key] = schedule
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return schedule


def _metadata_loss(output: Any) -> torch.Tensor:
    """A loss that depends on every floating output, for torch's gradient-shape inference only."""
    leaves = [
        t for t in torch.utils._pytree.tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point()
    ]
    return sum(t.sum() for t in leaves) * 0.0
