"""Which configurations fit a memory budget on N devices, and which of those is fastest.

Every plan of a :class:`~lightning_parallel.planner.search.Search` is sized by
:func:`~lightning_parallel.planner.estimate.predict` (each rank's device peak, and what its offload
keeps on the host) and timed by :func:`~lightning_parallel.planner.time_model.step_time` (the schedule
simulated with the unit times measured on this machine, the collectives and copies from the links),
from one measurement of the model. A plan **fits** when its fullest rank's device peak is within the
device budget less a safety margin (:data:`MARGIN`), and the host bytes of the ranks of one node
(they share its memory) are within the host budget less the same margin, as are the bytes they keep on
the node's disk (the disk tier's files) within the disk budget. The disk tier is kept only where it is
needed: a plan with the optimizer state on the disk fits only where the same plan with it on the host
does not (its node's host memory cannot hold the state). The chosen plan is the one
that fits with the least time per sample (ties: the smaller peak); a model on the meta device is not
timed, and its chosen plan is the most frugal that fits (the smallest peak), not a fast one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lightning_parallel._table import format_table
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import MemoryEstimate, format_bytes, predict
from lightning_parallel.planner.facts import ModelFacts, measure_model
from lightning_parallel.planner.links import Links
from lightning_parallel.planner.probe import StepFn, default_step
from lightning_parallel.planner.search import SEARCHED_SCHEDULES, Search
from lightning_parallel.planner.time_model import StepTime, step_time
from lightning_parallel.planner.units import find_units

MARGIN = 0.10
"""The safety margin: a plan fits when its predicted peak is at most 90% of the budget (the memory
model is validated within 15% of torch's meter, mostly within 5%; allocators round up)."""


@dataclass(frozen=True)
class Budget:
    """Bytes per device, per node's host and per node's disk (``None``: not checked), and the safety
    margin.

    Example::

        Budget(24 * 2**30, host=512 * 2**30, ranks_per_node=8, disk=4 * 2**40).fits(candidate)
    """

    device: int
    host: int | None = None
    ranks_per_node: int = 1
    margin: float = MARGIN
    disk: int | None = None

    def __post_init__(self) -> None:
        sizes = (self.host, self.disk)
        if self.device <= 0 or any(s is not None and s <= 0 for s in sizes) or not 0 <= self.margin < 1:
            raise ValueError(
                f"a budget needs positive bytes and a margin in [0, 1), got device={self.device}, "
                f"host={self.host}, disk={self.disk}, margin={self.margin}"
            )

    @property
    def usable(self) -> int:
        return int(self.device * (1 - self.margin))

    @property
    def usable_host(self) -> int | None:
        return None if self.host is None else int(self.host * (1 - self.margin))

    @property
    def usable_disk(self) -> int | None:
        return None if self.disk is None else int(self.disk * (1 - self.margin))

    def fits(self, c: Candidate) -> bool:
        return self.why_not(c) is None

    def why_not(self, c: Candidate) -> str | None:
        """None where ``c`` fits; else what it misses: ``"device"``, ``"host"``, ``"disk"``, or ``"not
        needed"`` (its state on the disk, where the node's host memory would hold it)."""
        host, disk = self.usable_host, self.usable_disk
        if c.peak > self.usable:
            return "device"
        if host is not None and c.host_per_node > host:
            return "host"
        if disk is not None and c.disk_per_node > disk:
            return "disk"
        if c.host_twin is not None and (host is None or c.host_twin <= host):
            return "not needed"
        return None

    def describe(self) -> str:
        host = f", host {format_bytes(self.host)} per node of {self.ranks_per_node}" if self.host else ""
        host += f", disk {format_bytes(self.disk)} per node" if self.disk else ""
        return f"{format_bytes(self.device)} per device{host} (margin {self.margin:.0%})"


@dataclass(frozen=True)
class Candidate:
    """One sized (and timed) plan: its estimate, its batches, its predicted step."""

    plan: ParallelPlan
    estimate: MemoryEstimate
    batch: int  # one replica's batch
    accumulate: int  # batches per optimizer step
    host_per_node: int
    time: StepTime | None = None
    disk_per_node: int = 0  # (the disk tier's files)
    host_twin: int | None = None  # (a disk-tier plan: its node's host bytes with the state on the host)

    @property
    def peak(self) -> int:
        return self.estimate.peak

    @property
    def samples(self) -> int:
        """Samples per optimizer step, over every replica."""
        return self.batch * self.accumulate * self.plan.data_parallel_size

    @property
    def seconds(self) -> float:
        return self.time.seconds if self.time is not None else float("nan")

    def reason(self) -> str:
        """Peak device and host bytes, and where the time goes."""
        host = f", host {format_bytes(self.host_per_node)} per node" if self.host_per_node else ""
        host += f", disk {format_bytes(self.disk_per_node)} per node" if self.disk_per_node else ""
        timed = f", {self.time.describe()}" if self.time is not None else ""
        return f"device peak {format_bytes(self.peak)}{host}{timed}"


def rank_plans(
    facts: ModelFacts, plans: list[ParallelPlan], search: Search, links: Links | None = None
) -> list[Candidate]:
    """Size (and, with ``links`` and timed facts, time) ``plans``; fastest first (see :func:`ranked`).

    Example::

        search = Search(devices=4, global_batch_size=32)
        ranked = rank_plans(facts, search.plans(8), search, links)
    """
    out = []
    for plan in plans:
        found = search.batches(plan)
        if found is None:
            continue
        batch, accumulate = found
        plan = replace(plan, accumulate_grad_batches=accumulate)
        estimate = predict(facts, plan, samples=batch)
        timed = None
        if links is not None and facts.times is not None and plan.strategy == "pipeline":
            timed = step_time(facts, links, plan, batch, accumulate)
        host, disk = (host_per_node(estimate, search.node_ranks, c) for c in ("host", "disk"))
        out.append(Candidate(plan, estimate, batch, accumulate, host, timed, disk,
                             _host_twin(facts, plan, batch, search.node_ranks)))  # fmt: skip
    return ranked(out)


def _host_twin(facts: ModelFacts, plan: ParallelPlan, batch: int, ranks_per_node: int) -> int | None:
    """A disk-tier plan's node host bytes were its optimizer state on the host instead (None: no disk)."""
    if plan.strategy != "pipeline" or plan.offload_to != "disk":
        return None
    twin = replace(plan, offload_to="host", offload_dir=None, offload_buffer=None)
    return host_per_node(predict(facts, twin, samples=batch), ranks_per_node)


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Least predicted time per sample first (untimed ones by peak); ties to the smaller peak."""
    return sorted(
        candidates,
        key=lambda c: (c.time is None, c.seconds / c.samples if c.time else 0.0, c.peak, c.plan.label()),
    )


def host_per_node(estimate: MemoryEstimate, ranks_per_node: int, column: str = "host") -> int:
    """The host bytes of the fullest node: the ranks of one node share its memory (``column="disk"``:
    the bytes its ranks keep on its disk).

    Global ranks fill the nodes in order (``ranks_per_node`` each); a rank holds its pipeline rank's
    offloaded bytes (:class:`~lightning_parallel.layout.ranks.RankLayout` places pipeline ranks outermost).
    """
    plan = estimate.plan
    if plan.strategy != "pipeline" or not any(getattr(r, column) for r in estimate.ranks):
        return getattr(estimate.ranks[0], column) if plan.strategy != "pipeline" else 0
    layout = plan.layout()
    nodes: dict[int, int] = {}
    for g in range(plan.world):
        node, pp_rank = g // ranks_per_node, layout.coordinates(g)[0]
        nodes[node] = nodes.get(node, 0) + getattr(estimate.ranks[pp_rank], column)
    return max(nodes.values())


def fastest_fit(candidates: list[Candidate], budget: Budget | int) -> Candidate | None:
    """The first (fastest) candidate that fits ``budget`` (bytes per device, no margin), or None."""
    budget = budget if isinstance(budget, Budget) else Budget(budget, margin=0.0)
    return next((c for c in candidates if budget.fits(c)), None)


def format_plan(candidates: list[Candidate], budget: Budget | int) -> str:
    """The table: one row per candidate, ``fits`` against ``budget``, the chosen one marked ``<-``."""
    budget = budget if isinstance(budget, Budget) else Budget(budget, margin=0.0)
    best = fastest_fit(candidates, budget)
    disk = any(c.disk_per_node for c in candidates)  # (a column only where a plan keeps files)
    headers = ["configuration", "batch/replica", "micro-batch", "device peak", "host/node",
               *(["disk/node"] if disk else []), "fits", "step", "bubble", ""]  # fmt: skip
    rows = []
    for c in candidates:
        mb = c.batch // c.plan.num_microbatches
        batch = f"{c.batch}" + (f" x{c.accumulate}" if c.accumulate > 1 else "")
        mark = "<- chosen" if c is best else ""
        step = f"{c.seconds * 1e3:.1f} ms" if c.time else "-"
        bubble = f"{c.time.bubble:.2f}" if c.time else "-"
        rows.append([c.plan.label(), batch, str(mb), format_bytes(c.peak), format_bytes(c.host_per_node),
                     *([format_bytes(c.disk_per_node)] if disk else []),
                     _fits(budget, c), step, bubble, mark])  # fmt: skip
    return format_table(headers, rows)


def _fits(budget: Budget, c: Candidate) -> str:
    why = budget.why_not(c)
    return "yes" if why is None else "not needed" if why == "not needed" else "no"


FRUGAL = "not timed: the most frugal plan that fits (the smallest device peak), not the fastest"
"""Why an untimed choice (a model on the meta device) is what it is: ranked by peak, not by time."""


def format_choice(candidates: list[Candidate], budget: Budget, others: int = 3) -> str:
    """The chosen plan, its ``PipelineStrategy(...)`` line, and the next ``others`` that fit, with why.

    Untimed plans (a model on the meta device) are ranked by their peak: the choice says it is the most
    frugal that fits, which leans to recomputation and offload, not a fast one."""
    fits = [c for c in candidates if budget.fits(c)]
    if not fits:
        return ""
    best = fits[0]
    lines = [f"chosen: {best.plan.label()} ({_seconds(best)}; {best.reason()})", f"    {best.plan.code()}"]
    for c in fits[1 : 1 + others]:
        slower = f"{c.seconds / best.seconds:.2f}x the time" if c.time and best.time else "untimed"
        lines.append(f"  then: {c.plan.label()} ({slower}; {c.reason()})")
    return "\n".join(lines)


def _seconds(c: Candidate) -> str:
    return f"{c.seconds * 1e3:.1f} ms per step" if c.time else FRUGAL


def measure_for(
    module: nn.Module,
    batch: Any,
    search: Search,
    optimizer: Any = None,
    step: StepFn = default_step,
    sync: Callable[[], None] | None = None,
    repeats: int = 3,
) -> dict[int, ModelFacts]:
    """The model measured for ``search``: at each tensor-parallel size, with its units timed at the
    search's smallest and largest micro-batch (``batch`` holds at least the largest), the median of
    ``repeats`` runs each; ``sync``: a barrier before each timed run (when every rank of a job times at once).

    Example::

        facts = measure_for(model, batch, Search(devices=2, global_batch_size=16))
    """
    sizes = search.micro_batch_sizes(find_units(module).max_stages)
    return {
        tp: measure_model(
            module, batch, search.precision, optimizer, step, tp, time_sizes=sizes, sync=sync, repeats=repeats
        )
        for tp in search.tensor_parallel_sizes
    }


def plan_search(
    facts: Mapping[int, ModelFacts], search: Search, links: Links | None = None
) -> list[Candidate]:
    """Every plan of ``search``, sized and timed with the facts measured at each tensor-parallel size.

    Example::

        facts = {1: measure_model(model, batch, time_sizes=(2, 8))}
        candidates = plan_search(facts, Search(devices=2, global_batch_size=16), links)
    """
    out: list[Candidate] = []
    for tp in search.tensor_parallel_sizes:
        f = facts[tp]
        out += rank_plans(f, search.plans(f.layout.max_stages, tp, f.layout.kind, f), search, links)
    return ranked(out)


def candidate_plans(
    devices: int,
    num_blocks: int,
    global_batch: int,
    precision: str = "32-true",
    pipeline_sizes: list[int] | None = None,
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES,
    layout: str = "",
    tensor_parallel_size: int = 1,
) -> list[ParallelPlan]:
    """Lightning's DDP (or one device) and the :class:`Search`'s plans without offload: a memory-only listing.
    ``layout``: how the model's units are laid out (``UnitLayout.kind``, see :meth:`Search.plans`).

    Example::

        candidate_plans(devices=4, num_blocks=10, global_batch=32)
    """
    search = Search(devices, global_batch, None, precision, tuple(pipeline_sizes or ()) or None, schedules,
                    offload=False)  # fmt: skip
    whole = "single_device" if devices == 1 else "ddp"
    ddp = global_batch % devices == 0 and tensor_parallel_size == 1
    out = [ParallelPlan(whole, devices, precision=precision)] if ddp else []
    return out + search.plans(num_blocks, tensor_parallel_size, layout)
