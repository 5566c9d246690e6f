"""What a technique is to the rest of the package: one base class whose members are all optional.

A technique (recomputation, tensor parallelism, FSDP2, offload, ...) is one module that defines one
subclass of :class:`Technique` and one instance of it (``TECHNIQUE``); ``techniques/__init__.py`` holds
them in one ordered tuple, and every composer folds that tuple: the plan (its fields' canonical
values, its refusals, its label), the planner's search (the variants it tries), the set-up (the job's
environment, what it reads on the unsplit module, the stages, the optimizers, a context around each
step, the gradient reductions of the optimizer step). Each member's default leaves everything as it is,
so a technique writes only what it does. No registry, no lookup by name: the tuple is read top to bottom.

A technique reads the plan duck-typed (any of its fields: FSDP2 reads ``plan.offload`` to keep its
shards on the host), never imports another technique, ``plan/``, ``sources/``, ``strategies/`` or
Lightning; what several techniques share lives one floor below (``layout/``, ``optim/``, ``grads/``).
It sees this rank's stages through the stage view (``pipeline/stage_source.py``: the same verbs on both
sources) and the unsplit module as an ``UnsplitModel``, never asking which source split it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_parallel.pipeline.stage_source import UnsplitModel


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

    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        """Reduce; ``finished``: the parameters that the reductions before this one finished."""


@dataclass(frozen=True)
class SearchOptions:
    """What the planner's search lets the techniques try (``Technique.variants``).

    Args:
        offload: try offloading to the host.
        offload_parameters: with ``offload``, FSDP2's offload of the shards too.
        shardable: FSDP2 can shard the model's stages (a split ``nn.Sequential``).

    Example::

        >>> SearchOptions(shardable=True).offload
        True
    """

    offload: bool = True
    offload_parameters: bool = True
    shardable: bool = False


@dataclass
class MemoryLedger:
    """One rank's bytes as the planner adds them up, for :meth:`Technique.memory` to move between columns.

    Not folded yet: ``memory/estimate.py`` composes each technique's arithmetic by name as before; a later
    piece moves each into its technique's ``memory`` (issue 51). The columns a technique moves bytes
    between are ``device``, ``host`` and ``disk``; ``in_flight`` counts the micro-batches held at once.

    Example::

        ledger = MemoryLedger(plan, facts, links, costs)
        ledger.device["optimizer"] -= state; ledger.host["optimizer"] += state
    """

    plan: Any
    facts: Any = None
    links: Any = None
    costs: list[Any] = field(default_factory=list)
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0


@dataclass
class TimeLedger:
    """One step's seconds as the time model adds them up, for :meth:`Technique.time` to add to.

    Not folded yet: ``memory/time_model.py`` composes each technique's time by name as before (a later
    piece). Per stage: extra ``forward``/``backward`` seconds; ``start``: an offset before the first
    forward (FSDP2's gathers); ``tail``: named items after the last backward (collectives, copies, the
    optimizer step).

    Example::

        ledger = TimeLedger(plan, facts, links)
        ledger.tail["offload copies"] = 2 * trainable_bytes / links.host_bandwidth
    """

    plan: Any
    facts: Any = None
    links: Any = None
    forward: dict[int, float] = field(default_factory=dict)
    backward: dict[int, float] = field(default_factory=dict)
    start: float = 0.0
    tail: dict[str, float] = field(default_factory=dict)


class Technique:
    """One technique. Every member is optional: the defaults leave everything as it is.

    ``name``: how the technique is called (``"offload"``). ``fields``: the ``ParallelPlan`` fields it owns
    (documented in ``ParallelPlan``); ``searched``: those of them the planner's search decides (a
    ``plan="auto"`` is not given them).

    Example::

        class Offload(Technique):
            name, fields = "offload", ("offload", "offload_pin_memory")

            def label(self, plan):
                return " +offload opt" if plan.offload else ""

        TECHNIQUE = Offload()
    """

    name: str = ""
    fields: tuple[str, ...] = ()
    searched: tuple[str, ...] = ()

    # --- the plan (plan/parallel_plan.py folds these in __post_init__, in the list's order)
    def normalized(self, plan: Any) -> dict[str, Any]:
        """Its fields' canonical values (a list as a tuple, ...); a TypeError or ValueError for a bad one."""
        return {}

    def check(self, plan: Any) -> None:
        """Refuse what cannot go together, with the value and the fix (ValueError/TypeError)."""

    def label(self, plan: Any) -> str:
        """Its part of the plan's short name (``" +offload opt"``, a leading space), ``""`` when off."""
        return ""

    def variants(self, plan: Any, search: SearchOptions) -> Iterable[dict[str, Any]]:
        """The option dicts the search tries on top of ``plan`` (``{}``: as it is); the plan's own checks
        reject what cannot combine."""
        yield {}

    # --- the job (strategies/pipeline/setup.py and strategy.py fold these)
    def environment(self, plan: Any, env: Environment) -> None:
        """What the job needs before its process group exists (``env.host_backend = ...``); refusals
        the device decides (a ValueError with the fix)."""

    def before_split(self, plan: Any, model: UnsplitModel) -> Any:
        """What it reads on the unsplit module, on every rank alike (kept as ``job.before_split[name]``;
        None: nothing); refusals of what the source's stages cannot take (a ValueError with the fix)."""
        return None

    def stages(self, view: Any, job: Job) -> str | None:
        """Transform this rank's stages (through the stage view's methods); a line for the log, or None."""
        return None

    def optimizers(self, optimizers: list[torch.optim.Optimizer], job: Job) -> list[torch.optim.Optimizer]:
        """The optimizers as the technique wraps or rebuilds them (right after ``configure_optimizers``)."""
        return optimizers

    def step_context(self, job: Job) -> AbstractContextManager[Any] | None:
        """A context entered around each schedule step (reused step after step), or None: the runner's
        only contexts. Training steps and forward-only ones (evaluation, under no_grad) alike."""
        return None

    def reductions(self, job: Job) -> list[Reduction]:
        """The gradient reductions the optimizer step's sync runs for this technique."""
        return []

    # --- the planner (not folded yet: memory/estimate.py and memory/time_model.py, a later piece)
    def memory(self, ledger: MemoryLedger) -> None:
        """Move bytes between the ledger's device, host and disk columns."""

    def time(self, ledger: TimeLedger) -> None:
        """Add seconds to the ledger's stages, start or tail."""


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
