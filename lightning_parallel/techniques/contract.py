"""What a technique is to the rest of the package: one base class whose members are all optional.

A technique (recomputation, tensor parallelism, FSDP2, offload, ...) is one module that defines one
subclass of :class:`Technique` and one instance of it (``TECHNIQUE``); ``techniques/__init__.py`` holds
them in one ordered tuple, and every composer folds that tuple: the plan (its fields' canonical
values, its refusals, its label), the planner's search (the variants it tries), the set-up (the job's
environment, what it reads on the unsplit module, the stages, the optimizers, a context around each
step, the gradient reductions of the optimizer step) and the planner (what one micro-batch costs a
stage, a rank's memory, a step's time: :class:`CostLedger`, :class:`MemoryLedger`,
:class:`TimeLedger`; what its time needs measured on the job: :class:`TimeBench`). Each member's
default leaves everything as it is, so a technique writes only what it does. No registry, no lookup by
name: the tuple is read top to bottom.

A technique reads the plan duck-typed (any of its fields: FSDP2 reads ``plan.offload`` to keep its
shards on the host), never imports another technique, ``plan/``, ``sources/``, ``strategies/`` or
Lightning; what several techniques share lives one floor below (``layout/``, ``optim/``, ``grads/``).
It sees this rank's stages through the stage view (``pipeline/stage_source.py``: the same verbs on both
sources) and the unsplit module as an ``UnsplitModel``, never asking which source split it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

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


@dataclass(frozen=True)
class SearchOptions:
    """What the planner's search lets the techniques try (``Technique.variants``).

    Args:
        offload: try offloading to the host.
        offload_parameters: with ``offload``, FSDP2's offload of the shards too.
        layout: how the measured model's units are laid out (``UnitLayout.kind``: ``"sequential"``, a
            split ``nn.Sequential``; ``"blocks"``; ``"whole"``; ``""``: not said).
        model: the measured model the plans are for (the planner's ``ModelFacts``: its units' modules,
            its batch's ``tokens``), read duck-typed; None: not given (a listing without a model).
        sequence_parallel: try splitting the sequence (``True``: wherever the model's heads allow;
            ``None``: where its sequence is long, too; ``False``: never).
        offload_dir: with ``offload``, the optimizer's offload keeps the state in files under it (the
            disk tier, ``offload_to="disk"``), not in host memory.

    Example::

        >>> SearchOptions(layout="sequential").offload
        True
    """

    offload: bool = True
    offload_parameters: bool = True
    layout: str = ""
    model: Any = field(default=None, compare=False)
    sequence_parallel: bool | None = None
    offload_dir: str | None = None


@dataclass
class CostLedger:
    """Every stage's bytes for one micro-batch, as the planner measured them, for
    :meth:`Technique.stage_costs` to change before anything else reads them.

    The planner (``planner/stage_costs.py``) builds one ``StageCosts`` per stage of the plan from the
    measured units as a plain stage keeps them (each unit's saved tensors, the output kept for backward,
    the receive buffers, the transients) and folds every technique's ``stage_costs`` over this ledger
    before the memory estimate and the time model read the costs: what one micro-batch costs a stage is
    what both of them start from (recomputation keeps less per micro-batch, so offloading activations
    copies less, and the time model charges the copy of what is kept).

    Args:
        plan: the plan (read duck-typed).
        facts: the measured model (``ModelFacts``: ``layout``, ``probe``, ``tensors``, ...).
        micro_batch: samples in one micro-batch.
        stages: every stage's ``StageCosts``, in stage order; a technique replaces the ones it changes
            (``dataclasses.replace``).

    Example::

        ledger = CostLedger(plan, facts, 4.0, costs)
        ledger.stages = [replace(c, per_microbatch=c.per_microbatch // 2) for c in ledger.stages]
    """

    plan: Any
    facts: Any
    micro_batch: float
    stages: list[Any] = field(default_factory=list)


DEVICE_COLUMNS = ("parameters", "gradients", "optimizer", "activations", "buffers", "gathered")
"""The device columns of a rank's peak (``RankMemory``'s), in the planner's table order."""


@dataclass
class MemoryLedger:
    """One pipeline rank's bytes as the planner adds them up, for :meth:`Technique.memory` to move between
    columns: ``planner/estimate.py`` fills it as plain replicas hold the rank's stages, folds every
    technique's ``memory`` in the list's order, then walks the schedule.

    **Phases.** ``memory`` runs once per rank, *before* the walk of the schedule: it changes what persists
    through the step (the ``device`` columns other than ``activations``, the ``host`` and ``disk``
    columns) and what each micro-batch costs the rank on its device (``stages``: the walk reads them for
    the activations, what the stages keep and the gradients that appear at each stage's first backward;
    ``activations`` and the walk's share of ``buffers`` come from it afterwards). What one micro-batch
    costs a stage *before* any rank's columns (recomputation) is :meth:`Technique.stage_costs`'s, earlier.
    **Order.** The list's: what shards a rank's state (FSDP2, ZeRO-1) comes before what moves state to the
    host (offload), so the offload moves the shards; a technique reads what the ones before it left.

    Args:
        plan, facts: the plan and the measured model (read duck-typed).
        rank: the pipeline rank.
        stages: this rank's ``StageCosts`` (after ``stage_costs``); a technique may replace them.
        keys: this rank's parameters (keys of ``facts.tensors``; a tied weight once).
        in_flight: per stage of this rank, the most micro-batches it holds at once (torch's schedule).
        whole: the device columns as a plain replica holds them before any technique (read them, do not
            change them: e.g. the optimizer state unsharded, the loss scaler's included).
        device: bytes per :data:`DEVICE_COLUMNS` entry (``activations`` is the walk's: 0 here).
        host, disk: bytes kept in host memory and on disk for this rank, by what they are.
        reduced_gradients: the gradient bytes this rank keeps once the step's reduction is done, which its
            optimizer steps (every gradient; FSDP2: its shard of them).
        notes: lines printed under the plan's table (what the estimate does not model exactly).

    Example::

        ledger.device["optimizer"] -= state         # the optimizer state off the device ...
        ledger.add_host("optimizer", state)           # ... onto the host
    """

    plan: Any
    facts: Any
    rank: int = 0
    stages: list[Any] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    in_flight: dict[int, int] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DEVICE_COLUMNS, 0))
    host: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)
    reduced_gradients: int = 0
    notes: list[str] = field(default_factory=list)

    def add_host(self, what: str, nbytes: int) -> None:
        """Keep ``nbytes`` more in host memory, under ``what``."""
        self.host[what] = self.host.get(what, 0) + nbytes


@dataclass(frozen=True)
class Line:
    """A measured cost as a straight line, ``intercept + slope x``, never below zero (``x``: samples of a
    micro-batch, or bytes of a unit's parameters). :meth:`through` fits it to measured points.

    Example::

        >>> round(Line.through([(2, 0.003), (8, 0.009)]).at(4), 6)
        0.005
    """

    intercept: float = 0.0
    slope: float = 0.0

    def at(self, x: float) -> float:
        return max(0.0, self.intercept + self.slope * x)

    @classmethod
    def through(cls, points: Iterable[tuple[float, float]]) -> Line:
        """The line through the first and last of ``(x, seconds)`` points by ``x`` (one point, or a
        falling pair: a constant, the larger of the two)."""
        ordered = sorted(points)
        (x0, y0), (x1, y1) = ordered[0], ordered[-1]
        if x1 <= x0 or y1 < y0:
            return cls(max(y0, y1))
        slope = (y1 - y0) / (x1 - x0)
        return cls(y0 - slope * x0, slope)


@dataclass(frozen=True)
class UnitSample:
    """One unit of the model with the inputs it was called with at each micro-batch size the probe timed.

    ``inputs[size]``: ``(args, kwargs)`` of the unit's call on ``size`` samples (tensors detached; those
    that required a gradient still do). A technique times a copy (``copy.deepcopy(sample.module)``).
    """

    name: str
    module: nn.Module
    inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


@dataclass
class TimeBench:
    """What :meth:`Technique.measure` may time on the job, once, before the search: every rank of the job
    calls every technique's ``measure`` with its own bench, at the same point and in the list's order, so
    a technique may use collectives (every rank makes the same calls).

    Args:
        ranks: the job's ranks (the world).
        device: the job's device.
        layout: how the model's units are laid out (``UnitLayout.kind``: ``"sequential"``: the stages
            call the modules; ``"blocks"``/``"whole"``: traced graphs, which run split weights on DTensors).
        samples: the model's units to time, with their inputs: its block first (a unit of the structure
            most units share), then its smallest unit with parameters.
        sizes: the micro-batch sizes of ``inputs`` (the search's smallest and largest).
        tensor_plans: per tensor-parallel size > 1 the model splits at, the plan the strategy would split it
            with (``TensorPlan``: styles and head counts by module path).
        repeats: timed repeats after a warm-up (the median is kept); small in tests.
        sync: lines the ranks up before each timed call (a barrier).
        mesh: ``mesh(shape, names)``: a ``DeviceMesh`` of the job's ranks (built once per shape, cached).
        dtensor_rules: registers the sharding rules the traced stages' DTensor graphs rely on.

    Example::

        def measure(self, bench):
            block = copy.deepcopy(bench.samples[0].module)
            ...
            return FsdpTimes(...)      # what ``time`` reads back: ``ledger.times.measured[self.name]``
    """

    ranks: int
    device: torch.device
    layout: str = ""
    samples: list[UnitSample] = field(default_factory=list)
    sizes: tuple[int, ...] = ()
    tensor_plans: dict[int, Any] = field(default_factory=dict)
    repeats: int = 3
    sync: Callable[[], None] = lambda: None
    mesh: Callable[..., Any] | None = None
    dtensor_rules: Callable[[], None] = lambda: None

    def inputs(self, sample: UnitSample, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``sample``'s recorded inputs at ``size`` samples, on the bench's device."""
        return tree_map(lambda t: t.to(self.device) if torch.is_tensor(t) else t, sample.inputs[size])

    def timed(self, fn: Callable[[], Any]) -> float:
        """The median seconds of ``fn`` over ``repeats`` runs after a warm-up, the ranks lined up first."""
        samples = []
        for _ in range(self.repeats + 1):
            self.sync()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])


TIME_SHARES = ("communication", "recompute", "offload")
"""What a stage's extra seconds are, as the step's time reports them (``StepTime``'s fields)."""


@dataclass
class TimeLedger:
    """One pipeline rank's seconds as the time model adds them up, for :meth:`Technique.time` to add to:
    ``planner/time_model.py`` fills it with the measured compute of the rank's stages and the plain
    step (the rank's trainable parameters), folds every technique's ``time`` in the list's order, then
    simulates the schedule from every rank's ledger and adds each rank's tail.

    **Phases.** ``time`` runs once per rank, before the simulation: per stage of the rank, extra
    ``forward``/``backward`` seconds per micro-batch (each also charged to one of :data:`TIME_SHARES` in
    ``shares``, what the step's time reports); ``start``: seconds before the rank's first forward (FSDP2's
    all-gather); ``tail``: seconds after its last backward, by :data:`TIME_SHARES` entry, and the optimizer
    step (``tail["optimizer"]``; left unset, the step on the device of ``step_elements`` elements in
    ``step_tensors`` tensors). **Order.** The list's: a technique that shards the optimizer step
    (``step_elements``) or reduces the gradients (``unreduced``) comes before the plain replicas'
    all-reduce (which reduces what is left) and before what moves the step to the host (offload), which
    prices the step it finds.

    Args:
        plan, facts, links: the plan, the measured model (``facts.times``: its unit times) and the links.
        rank: the pipeline rank.
        stages: this rank's ``StageCosts`` (after ``stage_costs``).
        keys: this rank's parameters (keys of ``facts.tensors``; a tied weight once).
        micro_batch: samples in one micro-batch.
        forward, backward: per stage of the rank, seconds per micro-batch (the measured compute first).
        shares: per stage, seconds of its forward + backward by :data:`TIME_SHARES` entry.
        start: seconds before the rank's first forward.
        gradients: bytes of the rank's gradients; ``unreduced``: those no reduction has charged yet.
        step_elements, step_tensors: what the rank's optimizer step updates.
        tail: seconds after the schedule, by :data:`TIME_SHARES` entry, and ``"optimizer"``.
        recomputed: the units whose forward runs again in backward (recomputation's): a technique that
            changes a unit's forward after it (tensor parallelism's split blocks) charges the change twice.

    Example::

        ledger.backward[stage] += again            # a recomputed forward in each backward
        ledger.share(stage, "recompute", again)
        ledger.tail["offload"] += 2 * ledger.links.copy(trainable_bytes)
    """

    plan: Any
    facts: Any
    links: Any = None
    rank: int = 0
    stages: list[Any] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    micro_batch: float = 0.0
    forward: dict[int, float] = field(default_factory=dict)
    backward: dict[int, float] = field(default_factory=dict)
    shares: dict[int, dict[str, float]] = field(default_factory=dict)
    start: float = 0.0
    gradients: float = 0.0
    unreduced: float = 0.0
    step_elements: float = 0.0
    step_tensors: float = 0.0
    tail: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIME_SHARES, 0.0))
    recomputed: set[str] = field(default_factory=set)

    @property
    def times(self) -> Any:
        """The measured unit times and optimizer steps (``TimeFacts``)."""
        return self.facts.times

    def share(self, stage: int, what: str, seconds: float) -> None:
        """Charge ``seconds`` of ``stage``'s forward + backward to ``what`` (one of :data:`TIME_SHARES`)."""
        shares = self.shares.setdefault(stage, {})
        shares[what] = shares.get(what, 0.0) + seconds


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
    def batch(self, plan: Any, mesh: Any, module: nn.Module) -> Callable[[Any], Any] | None:
        """A transform of every batch this rank's steps get (training, evaluation, prediction) and of the
        first input the sources split at, before anything reads it (micro-batches, item counts, the
        user's step); None: the batch as it comes. Made once per job, before the split, on every rank
        (sequence parallelism: this rank's shard of each sequence). It may hook the module's calls that
        the batch's shape decides (``position_ids``)."""
        return None

    def call_keywords(self, plan: Any, mesh: Any, module: nn.Module) -> Callable[[str, dict], dict] | None:
        """A transform ``(path, kwargs) -> kwargs`` of the keywords the user's step passes the pipelined
        call (``path``: the called module's in ``module``; a Hugging Face model's ``labels=``), applied
        where the call is captured (the first input the sources split at, then every step that feeds or
        counts it), before they are bound; None: as they come. Made once per job, with :meth:`batch`,
        on every rank; it may run collectives of a group whose ranks all capture alike (sequence
        parallelism: the next shard's first label)."""
        return None

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

    def teardown(self, optimizers: list[torch.optim.Optimizer], job: Job, interrupted: bool = False) -> None:
        """Release what its optimizers hold outside the process's memory (files, threads) when the run
        ends: normally, by a stop, or by an error (the strategy's teardown). ``interrupted``: by a stop
        or an error; else normally, and a checkpoint may still be saved from the optimizers (Lightning's
        ``on_fit_end``, ``trainer.save_checkpoint`` after ``fit``): keep what their ``state_dict()`` needs."""

    def step_context(self, job: Job) -> AbstractContextManager[Any] | None:
        """A context entered around each schedule step (reused step after step), or None: the runner's
        only contexts. Training steps and forward-only ones (evaluation, under no_grad) alike."""
        return None

    def reductions(self, job: Job) -> list[Reduction]:
        """The gradient reductions the optimizer step's sync runs for this technique."""
        return []

    # --- the planner (planner/stage_costs.py, planner/estimate.py, planner/time_model.py fold these)
    def stage_costs(self, ledger: CostLedger) -> None:
        """Change what one micro-batch costs each stage (``ledger.stages``), before any rank's columns:
        what both the memory estimate and the time model start from."""

    def memory(self, ledger: MemoryLedger) -> None:
        """Move one rank's bytes between the ledger's device, host and disk columns (before the walk of
        the schedule; see :class:`MemoryLedger` for the phases and the order)."""

    def measure(self, bench: TimeBench) -> Any:
        """Time on the job what its ``time`` needs measured in place (every rank calls it; collectives are
        allowed); what it returns, ``time`` reads as ``ledger.times.measured[self.name]``. ``None``:
        nothing measured (``time`` then models its effect from the links). An error on any rank leaves
        the measurement out on every rank."""
        return None

    def time(self, ledger: TimeLedger) -> None:
        """Add seconds to one rank's stages, start or tail (see :class:`TimeLedger`)."""


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
