"""Drive torch.distributed.pipelining: one PipelineStage set and schedule per input shape, cached.

A schedule fixes its activation shapes at its first step (torch 2.13: a later batch of another size
fails and takes the peer rank down, pytorch#159942), so each distinct batch shape, micro-batch count and
mode (train / forward-only) gets its own stages and schedule, built on first use on every rank alike
(:meth:`PipelineRunner._schedule`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleGPipe, ScheduleZBVZeroBubble

from lightning_parallel.layout.choices import is_multi_stage, schedule_class
from lightning_parallel.pipeline._v_forward import VForwardOnly
from lightning_parallel.pipeline.microbatches import first_microbatch
from lightning_parallel.pipeline.stage_source import StageSource


class PipelineRunner:
    """This rank's stages and the cached schedules that run them.

    Args:
        stages: where this rank's torch stages come from, a
            :class:`~lightning_parallel.pipeline.stage_source.StageSource` (the Sequential's or the
            traced forward's): its stages for each new shape.
        num_stages: stages in the whole pipeline.
        schedule: a name from :data:`~lightning_parallel.layout.choices.SCHEDULES`.
        num_microbatches: micro-batches per batch (fewer for a batch it does not divide).

    Example::

        runner = PipelineRunner(SequentialStages([stage_mod], [rank], 2, device, pp_group), 2, "1f1b", 4)
        runner.train_step(key, m, args_or_none, loss_fn)   # forward + backward of every micro-batch
    """

    max_cached = 8

    def __init__(self, stages: StageSource, num_stages: int, schedule: str, num_microbatches: int) -> None:
        self.stages = stages
        self.stage_indices = list(stages.stage_indices)
        self.num_stages = num_stages
        self.schedule_cls = schedule_class(schedule)
        self.num_microbatches = num_microbatches
        self.has_first = 0 in self.stage_indices
        self.has_last = num_stages - 1 in self.stage_indices
        # Under a loop placement only pipeline_size=1 puts a stage and the next on one rank (on every rank).
        self._adjacent_here = any(s + 1 in self.stage_indices for s in self.stage_indices)
        self._cache: OrderedDict[Hashable, Any] = OrderedDict()
        self._loss_fn: Callable[[Any, int], torch.Tensor] | None = None
        self._metadata_call_pending = False
        self._seen: list[int] = []
        # The techniques' contexts around every schedule step (offload's saved-tensor hooks, traced
        # tensor-parallel stages' implicit replication): the only contexts a step runs in.
        self.step_contexts: tuple[AbstractContextManager[Any], ...] = ()

    def use_step_contexts(self, contexts: Sequence[AbstractContextManager[Any]]) -> None:
        """Enter ``contexts`` (in order, each reused step after step) around every schedule step, training
        and forward-only (which runs under no_grad: saved-tensor hooks see nothing there)."""
        self.step_contexts = tuple(contexts)

    def needs_input(self, key: Hashable, num_microbatches: int, train: bool) -> bool:
        """Whether this rank needs the pipelined call's input (to feed the schedule, or to build one)."""
        if self.has_first:
            return True
        return self.stages.needs_example and (_mode(train), key, num_microbatches) not in self._cache

    def clear(self) -> None:
        """Drop every cached stage and schedule (they hold process-group state and buffers)."""
        self._cache.clear()

    def train_step(
        self,
        key: Hashable,
        num_microbatches: int,
        args: tuple[Any, ...] | None,
        loss_fn: Callable[[Any, int], torch.Tensor],
    ) -> None:
        """Forward and backward of every micro-batch; ``loss_fn(output_chunk, index)`` on the last stage."""
        cache_key = ("train", key, num_microbatches)
        new = cache_key not in self._cache
        schedule = self._schedule(cache_key, num_microbatches, args, train=True)
        # torch 2.13 infers a new manual PipelineStage's metadata at its first step by calling loss_fn
        # once on a dummy output of micro-batch 0, before the real micro-batches: that call must not
        # reach the user's training_step (it would log or update metrics with garbage). Stages given
        # their shapes (static mode: traced stages, Sequential stages sized on fake tensors) make none.
        # torch workaround: no upstream issue found
        #   canary: test_torch_schedules_call_loss_fn_once_per_micro_batch_when_they_infer_shapes
        self._metadata_call_pending = self.has_last and new and not self.stages.shapes_given
        target = torch.arange(num_microbatches) if self.has_last else None
        self._loss_fn, self._seen = loss_fn, []
        try:
            # The step's outputs reach the user's step through loss_fn, one micro-batch at a time: not
            # asking for them merged lets the last stage free each output at its backward (and a
            # forward that returns a scalar loss beside its logits, as nanoGPT's does, needs no merge).
            with self._in_step_contexts():
                schedule.step(*(args if self.has_first else ()), target=target, return_outputs=False)
        finally:
            self._loss_fn = None
        if self.has_last and sorted(self._seen) != list(range(num_microbatches)):
            raise RuntimeError(
                f"the pipeline schedule computed the loss of micro-batches {self._seen}, expected each of "
                f"0..{num_microbatches - 1} once: torch.distributed.pipelining changed how it calls loss_fn "
                f"(checked against torch 2.13)"
            )

    def forward(
        self,
        key: Hashable,
        num_microbatches: int,
        args: tuple[Any, ...] | None,
        merge_weights: list[float] | None = None,
    ) -> Any:
        """Forward only; returns the merged output of the whole batch on the last stage, else None.

        ``merge_weights``: what each micro-batch counts for when scalar outputs (a mean loss computed
        inside the model) are merged into the batch's (default: equally).
        """
        schedule = self._schedule(("eval", key, num_microbatches), num_microbatches, args, train=False)
        with self.stages.merging(merge_weights), self._in_step_contexts():
            return schedule.step(*(args if self.has_first else ()))

    @contextlib.contextmanager
    def _in_step_contexts(self) -> Iterator[None]:
        with contextlib.ExitStack() as around:
            for context in self.step_contexts:
                around.enter_context(context)
            yield

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        # The schedule splits `target` = arange(m) into one index per micro-batch.
        assert self._loss_fn is not None
        if self._metadata_call_pending:
            self._metadata_call_pending = False
            return _metadata_loss(output)
        self._seen.append(int(index.item()))
        return self._loss_fn(output, self._seen[-1])

    # torch workaround: https://github.com/pytorch/pytorch/issues/159942
    #   canary: test_torch_schedules_take_a_batch_of_another_shape_after_their_first
    def _schedule(self, key: Hashable, num_microbatches: int, args: Any, train: bool) -> Any:
        if key in self._cache:
            self._cache.move_to_end(key)
            schedule, stages = self._cache[key]
            self.stages.activate(stages)
            return schedule
        example = None
        if self.stages.needs_example:
            if args is None:
                raise RuntimeError("internal error: a new traced schedule needs the input on every rank")
            example = first_microbatch(args, num_microbatches)
        stages = self.stages.build(_mode(train), num_microbatches, example)
        loss_fn = self._loss if train else None
        cls = self.schedule_cls
        if not is_multi_stage(cls) and num_microbatches < self.num_stages and cls is not ScheduleGPipe:
            # 1F1B needs at least one micro-batch per stage; a short batch falls back to GPipe,
            # which runs the same stages in the same order of micro-batches.
            cls = ScheduleGPipe
        if cls is ScheduleDualPipeV and num_microbatches < self.num_stages:
            # DualPipeV needs a micro-batch per stage; a short batch runs ZBV on the same V placement.
            cls = ScheduleZBVZeroBubble
        if not train and (cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV) or self._adjacent_here):
            # torch's V schedules always run their backward actions, and torch's forward-only step of
            # any multi-stage schedule fails where two adjacent stages share a rank (every stage on one
            # rank at pipeline_size=1, where the loop and the V placements are the same).
            # torch workaround: no upstream issue found
            #   canary: test_torch_runs_a_forward_only_step_of_adjacent_stages_on_one_rank
            cls = VForwardOnly
        target = stages if is_multi_stage(cls) else stages[0]
        # scale_grads=False: the loss is scaled instead (see the strategy); torch's default divides
        # every .grad by m after each step, which breaks gradient accumulation across steps.
        merge_spec = self.stages.output_merge_spec(num_microbatches) if self.has_last else None
        schedule = cls(
            target, num_microbatches, loss_fn=loss_fn, scale_grads=False, output_merge_spec=merge_spec
        )
        self._cache[key] = (schedule, stages)
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        # Stages built per input shape may share one module (a sharded traced stage): it must run the
        # graph of the schedule about to step.
        self.stages.activate(stages)
        return schedule


def _mode(train: bool) -> str:
    return "train" if train else "eval"


def _metadata_loss(output: Any) -> torch.Tensor:
    """A loss that depends on every floating output, for torch's gradient-shape inference only."""
    leaves = [
        t for t in torch.utils._pytree.tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point()
    ]
    return sum(t.sum() for t in leaves) * 0.0
