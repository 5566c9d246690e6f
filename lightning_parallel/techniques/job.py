"""The job's side of the technique contract: what a technique is given at set-up and in the steps, and the
gradient reductions it gives back.

The strategy folds the techniques' set-up members (``Technique.environment``, ``stages``,
``optimizers``, ``step_context``, ``reductions``) with these values: :class:`Environment` (what the job
needs before its process group exists), :class:`Job` (this rank's job after the split: the plan, the
mesh, the stage view, ...), :class:`StepPhase` (what the batch about to run is to the optimizer step)
and :class:`Reduction` (one gradient reduction of the optimizer step, run by ``grads/sync.py``); with
:func:`pins` and :func:`buffers_to`, the two rules about host memory they share. They live apart from
the contract (``contract.py``: the members' signatures) and from the planner's values
(``ledgers.py``), so the set-up's data is read in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def _quiet(message: str) -> None:
    """The default ``warn``/``info`` of a job: say nothing (the strategy passes rank 0's logging)."""


@dataclass
class Environment:
    """What the job needs before its process group exists, folded from the techniques (each may set it).

    Args:
        device: the device the stages run on (read by the techniques: a CPU job cannot pin memory).
        host_backend: why the process group needs a host backend beside the device's (host tensors meet
            collectives), in words; ``None``: it does not.
        parameters_on_host: the stages' parameters stay on the host (FSDP2's offloaded shards): the
            strategy moves only the buffers to the device (:func:`buffers_to`).

    Example::

        env = environment(plan, torch.device("cuda", 0))     # techniques/__init__.py folds the list
        if env.host_backend:
            backend = "cuda:nccl,cpu:gloo"
    """

    device: torch.device
    host_backend: str | None = None
    parameters_on_host: bool = False


@dataclass
class StepPhase:
    """What the training batch about to run is to the optimizer step: set by the strategy before each
    training schedule (and cleared after it), read by a technique's step context (one object for the job).

    Args:
        microbatches: the batch's micro-batches (each stage runs one backward per micro-batch).
        reduces: this batch ends the optimizer step's accumulation window and its backward leaves the
            window's whole gradient in ``.grad``: a reduction may start on a gradient as soon as its last
            micro-batch's backward has run (the overlapped all-reduce). False in the batches before the
            last, outside training, and where the batch's gradients are kept aside and added to earlier
            ones afterwards.

    Example::

        phase = StepPhase()
        phase.microbatches, phase.reduces = 4, True   # the strategy, before a window's last batch
    """

    microbatches: int = 0
    reduces: bool = False


@dataclass(frozen=True)
class Job:
    """This rank's job as the techniques see it at set-up: built once, after the split.

    Args:
        plan: the job's ``ParallelPlan`` (read duck-typed).
        mesh: this rank's ``PipelineMesh`` (its process groups, its device mesh).
        device: the stages' device.
        stages: this rank's stage source (``StageSource``): the stage view the techniques act on.
        module: the LightningModule after the split (this rank's modules).
        table: the stage table (``StagePlan``): which stage holds which units.
        before_split: what each technique read on the unsplit module (:meth:`Technique.before_split`),
            by its name (a tensor-parallel plan under ``"tensor_parallel"``).
        schedulers: the LR schedulers of the optimizers (set before the optimizers are transformed).
        warn, info: rank 0's logging, passed by the strategy (a technique imports no Lightning).
        phase: what the training batch about to run is to the optimizer step (:class:`StepPhase`, the
            strategy's, updated before each training schedule).
        tied: the canonical names of this rank's tied weights (summed over the pipeline ranks that hold
            them before the replicas' reduction).

    Example::

        job = Job(plan, mesh, torch.device("cpu"), runner.stages, module)
        notes = [n for t in TECHNIQUES if (n := t.stages(job.stages, job))]
    """

    plan: Any
    mesh: Any
    device: torch.device
    stages: Any
    module: nn.Module
    table: Any = None
    before_split: Mapping[str, Any] = field(default_factory=dict)
    schedulers: tuple[Any, ...] = ()
    warn: Callable[[str], Any] = _quiet
    info: Callable[[str], Any] = _quiet
    phase: StepPhase = field(default_factory=StepPhase)
    tied: tuple[str, ...] = ()

    @property
    def pin_memory(self) -> bool:
        """Whether host copies are page-locked: as the plan asks, else on an accelerator."""
        return pins(self.plan.offload_pin_memory, self.device)


class Reduction:
    """One gradient reduction of the optimizer step, run once per step after the window's last backward.

    ``params``: the parameters whose gradients it finishes (the reductions after it leave them alone).
    ``before_tied_sum``: it runs before the tied weights' replicas sum their gradients, which then sum
    what it leaves (FSDP2's reduce-scatter: the tied replicas sum their shards); the others run after.

    Example::

        class Sum(Reduction):
            def __call__(self, finished):
                all_reduce_coalesced([p.grad for p in params if p not in finished], group)
    """

    params: Collection[torch.Tensor] = ()
    before_tied_sum: bool = False
    spans: Sequence[tuple[str, int, int]] = ()
    """What it ran beside the step's compute in the last optimizer step, for the timeline: ``(name,
    start, end)`` on ``time.perf_counter_ns``'s clock (the overlapped buckets' all-reduces)."""

    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        """Reduce; ``finished``: the parameters that the reductions before this one finished."""


def pins(offload_pin_memory: bool | None, device: torch.device) -> bool:
    """Whether the host copies are page-locked: as asked, else when the stages run on an accelerator.

    Example::

        >>> pins(None, torch.device("cpu")), pins(None, torch.device("cuda", 0))
        (False, True)
    """
    return device.type != "cpu" if offload_pin_memory is None else offload_pin_memory


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers to ``device``, leaving its parameters where they are (FSDP2's host shards):
    how the strategy puts a module on its device when ``Environment.parameters_on_host``.

    Example::

        buffers_to(stage, torch.device("cuda", 0))   # a BatchNorm's running stats on the GPU
    """
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)
