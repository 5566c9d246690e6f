"""The planner's side of the technique contract: the ledgers a technique's effects are folded into, and the
bench it may time on.

The planner asks every technique of the list, in order, what it does to one micro-batch's cost of a
stage (:class:`CostLedger`, ``Technique.stage_costs``), to a pipeline rank's bytes
(:class:`MemoryLedger`, ``Technique.memory``) and to its step's seconds (:class:`TimeLedger`,
``Technique.time``), and what to time on the job before the search (:class:`TimeBench`,
``Technique.measure``, with the measured model's :class:`UnitSample` and the :class:`Line` a
measurement is fitted as). These are plain data that a technique changes and the planner reads back:
they live apart from the contract (``contract.py``) so that the members' signatures and the values the
planner's folds carry are each read in one place; the job's side is ``job.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map


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
        optimizer: ``make(params)``: the model's optimizer (its class and settings) over ``params``, to
            step on a technique's own tensors (FSDP2's DTensor shards); None: not measured.

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
    optimizer: Callable[[list[Any]], Any] | None = None

    def inputs(self, sample: UnitSample, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``sample``'s recorded inputs at ``size`` samples, on the bench's device, with ``None`` for an
        object among its keyword inputs (a Hugging Face layer's key-value cache): the recorded one is
        shared and filled by every call (each timed call would attend to the last one's keys, or backward
        through its freed graph); a stage holds none."""
        args, kwargs = tree_map(lambda t: t.to(self.device) if torch.is_tensor(t) else t, sample.inputs[size])

        def plain(value: Any) -> bool:
            leaves = tree_leaves(value)
            return all(
                torch.is_tensor(t) or t is None or isinstance(t, (bool, int, float, str)) for t in leaves
            )

        return args, {key: value if plain(value) else None for key, value in kwargs.items()}

    def timed(self, fn: Callable[[], Any]) -> float:
        """The median seconds of ``fn`` over ``repeats`` runs after a warm-up, the ranks lined up first."""
        samples = [self.span(fn) for _ in range(self.repeats + 1)]
        return statistics.median(samples[1:])

    def span(self, fn: Callable[[], Any]) -> float:
        """Seconds of one run of ``fn`` from the ranks lined up (:attr:`sync`) to its end on this rank."""
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @staticmethod
    def backward(out: Any) -> None:
        """The backward of a timed block's output: of the sum of its float tensors that need gradients
        (a DTensor's local shard: the split block's backward, not a reduction added to it); nothing when
        none do."""
        floats = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in floats]
        if local:
            sum(t.float().sum() for t in local).backward()


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
    step_extra: float = 0.0  # the optimizer step's seconds beyond its plain tensors' (FSDP2's DTensors)
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
