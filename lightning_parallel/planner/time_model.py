"""Predict the seconds of one optimizer step of a plan: the schedule simulated, then the step's tail.

Beside the memory model, from the same measurement of the model (:class:`ModelFacts`, with its unit
times from :mod:`~lightning_parallel.planner.time_probe`) and the links
(:mod:`~lightning_parallel.planner.links`):

1. **Each stage's forward and backward per micro-batch**: its units' measured lines at the
   micro-batch's size, then what each technique adds (``Technique.time``, folded over a
   :class:`~lightning_parallel.techniques.ledgers.TimeLedger` per pipeline rank in the list's order):
   in backward, the forward of each recomputed unit once more; with tensor parallelism each split block
   as it measured in place (or the all-reduces of each split block); FSDP2's hooks on each unit (measured
   in place); with offloaded activations, their copy to the host in forward and back in backward. Each
   forward or backward also pays the runtime's bookkeeping (the links' ``StepOverhead.action``), and
   runs at the ratio the job measured between its stages as the strategy's step runs them and their
   units' timed sum (``StepOverhead.compute``, ``calibration.as_run``).
2. **The schedule, simulated**: each pipeline rank runs its actions in torch's own order
   (:func:`~lightning_parallel.planner.schedule.rank_actions`), an action starting when its rank is free
   and its input has arrived (the previous stage's forward, or the next stage's backward, plus the
   point-to-point transfer of the boundary's activation bytes when the stages sit on two ranks). The
   bubble and the stage imbalance come out of the simulation, not from a formula; with accumulation the
   schedule runs once per batch of the window.
3. **The step's tail**, after the schedule, not overlapped (this package's ``GradientSync`` runs once
   after the schedule): the techniques' reductions and copies (the replicas' all-reduce of the gradients
   in one coalesced message, or FSDP2's reduce-scatters, whose all-gathers are charged before the first
   forward; ZeRO-1's broadcast of each updated parameter from its owner; offload's copies), then the
   optimizer step (per element and per tensor, on the device unless a technique moved it; on FSDP2's
   DTensor shards, what their step measured in place adds). Every
   collective message pays the latency.

The step time is the last rank's finish, plus what every step pays whatever the plan (the links'
:class:`~lightning_parallel.planner.links.StepOverhead`, measured on the job: a trivial stage run through
the strategy's own step, per step and per batch; Lightning's loop around the step, timed on a one-device
Trainer of its own, per step and per batch; then the job's own model as replicas at two accumulation
windows, whose steps beyond the prediction set the stages' ``compute`` ratio and add the rest of its step
to ``per_step``, and as a pipeline of two ranks at two micro-batch counts, what a pipelined forward,
backward and batch pay beyond the model: both fits in :mod:`~lightning_parallel.planner.calibration`).
What is not modelled: the job's own callbacks' work, the overlap of communication with compute (the links
carry its measured slowdown, ``Links.overlapped``, for a technique that overlaps), other jobs on the
machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lightning_parallel.layout.choices import placement
from lightning_parallel.pipeline.plan import stage_rank
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.facts import ModelFacts
from lightning_parallel.planner.links import Links
from lightning_parallel.planner.probe import BEFORE
from lightning_parallel.planner.schedule import Action, rank_actions
from lightning_parallel.planner.stage_costs import StageCosts, stage_costs
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.ledgers import TimeLedger


@dataclass(frozen=True)
class StageTime:
    """One stage's seconds per micro-batch; ``send``: the bytes of its output (and of that output's
    gradient coming back). ``shares``: of forward + backward, the seconds of communication, recomputation
    and offload (:data:`~lightning_parallel.techniques.ledgers.TIME_SHARES`)."""

    index: int
    forward: float
    backward: float
    send: int
    shares: dict[str, float] = field(default_factory=dict)

    def share(self, what: str) -> float:
        return self.shares.get(what, 0.0)


@dataclass(frozen=True)
class Simulation:
    """When each pipeline rank finished its actions, and how long it computed.

    Example::

        sim = simulate(rank_actions("1f1b", 4, 1, 8), lambda a: 1.0 if a.kind == "F" else 2.0)
        sim.bubble          # 3 / 11: (p - 1) / (m + p - 1) for equal stages
    """

    finish: tuple[float, ...]
    busy: tuple[float, ...]
    waited: tuple[float, ...]  # of the idle time, waiting for a transfer in flight
    start: tuple[float, ...] = ()

    @property
    def makespan(self) -> float:
        return max(self.finish, default=0.0)

    @property
    def bubble(self) -> float:
        """The idle share of the busiest rank's schedule (waiting for other ranks), from its start."""
        r = max(range(len(self.busy)), key=self.busy.__getitem__)
        span = self.makespan - (self.start[r] if self.start else 0.0)
        return max(0.0, 1 - self.busy[r] / span) if span > 0 else 0.0

    @property
    def imbalance(self) -> float:
        """The busiest rank's compute over the mean rank's (1: balanced stages)."""
        mean = sum(self.busy) / len(self.busy) if self.busy else 0.0
        return max(self.busy) / mean if mean else 1.0


def simulate(
    actions: Sequence[Sequence[Action]],
    duration: Callable[[Action], float],
    transfer: Callable[[Action], float] | None = None,
    rank_of: Callable[[int], int] | None = None,
    start: Sequence[float] | None = None,
) -> Simulation:
    """Run each rank's actions in order; an action waits for its rank and for its input.

    Args:
        actions: per pipeline rank, its compute actions in torch's order.
        duration: seconds of an action.
        transfer: seconds for the input of an action to arrive from the rank that produced it
            (called only when that rank differs; default: free).
        rank_of: the rank of a stage (default: the rank whose list holds it).
        start: the time each rank starts (e.g. after an all-gather; default 0).

    Raises:
        ValueError: the orders deadlock (an action waits for one that can never run).

    Example::

        simulate(rank_actions("gpipe", 2, 1, 4), lambda a: 1.0).makespan      # 10.0 = 2 (m + p - 1)
    """
    owner = {a.stage: r for r, acts in enumerate(actions) for a in acts}
    rank_of = rank_of or owner.__getitem__
    num_stages = max(owner, default=-1) + 1
    done: dict[tuple[str, int, int], float] = {}
    clock = list(start or [0.0] * len(actions))
    busy, waited = [0.0] * len(actions), [0.0] * len(actions)
    position = [0] * len(actions)
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(actions):
            while position[r] < len(acts):
                a = acts[position[r]]
                ready = _input_ready(a, done, num_stages, rank_of, r, transfer)
                if ready is None:
                    break
                begin = max(clock[r], ready[0])
                waited[r] += max(0.0, min(begin, ready[0]) - max(clock[r], ready[1]))
                seconds = duration(a)
                clock[r] = begin + seconds
                busy[r] += seconds
                done[(a.kind, a.stage, a.microbatch)] = clock[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [acts[position[r]] for r, acts in enumerate(actions) if position[r] < len(acts)]
            raise ValueError(f"the schedule's orders deadlock at {stuck}")
    return Simulation(tuple(clock), tuple(busy), tuple(waited), tuple(start or [0.0] * len(actions)))


def _input_ready(
    a: Action,
    done: dict[tuple[str, int, int], float],
    num_stages: int,
    rank_of: Callable[[int], int],
    rank: int,
    transfer: Callable[[Action], float] | None,
) -> tuple[float, float] | None:
    """``(when the input is here, when its producer finished)``, or None while it is not produced."""
    if a.kind == "F":
        source = ("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
    elif a.kind == "W":
        source = ("I", a.stage, a.microbatch)
    elif a.stage == num_stages - 1:
        source = ("F", a.stage, a.microbatch)
    else:
        upstream = ("B", a.stage + 1, a.microbatch)
        source = upstream if upstream in done else ("I", a.stage + 1, a.microbatch)
    if source is None:
        return 0.0, 0.0
    if source not in done:
        return None
    produced = done[source]
    crossing = source[1] != a.stage and rank_of(source[1]) != rank
    return (produced + (transfer(a) if crossing and transfer else 0.0)), produced


# ---------------------------------------------------------------------------------- a plan's step


@dataclass(frozen=True)
class StepTime:
    """The predicted seconds of one optimizer step, and where they go (on the rank that finishes last).

    ``bubble``: the idle share of the busiest rank's schedule; ``imbalance``: its compute over the mean
    rank's; ``communication``: seconds of collectives plus the transfers the busiest rank waited for;
    ``recompute``: recomputed forwards; ``offload``: host copies and the host step's extra over the
    device's; ``overhead``: what every step pays whatever the plan computes (the links'
    :class:`~lightning_parallel.planner.links.StepOverhead`, on the last rank: per step, per batch, per
    action).
    """

    seconds: float
    schedule: float
    bubble: float
    imbalance: float
    communication: float
    recompute: float
    offload: float
    optimizer: float
    overhead: float = 0.0

    def describe(self) -> str:
        overhead = f", overhead {self.overhead * 1e3:.1f} ms" if self.overhead else ""
        return (
            f"bubble {self.bubble:.0%}, imbalance {self.imbalance:.2f}, communication "
            f"{self.communication * 1e3:.1f} ms, recomputation {self.recompute * 1e3:.1f} ms, offload "
            f"{self.offload * 1e3:.1f} ms{overhead}"
        )


def step_time(
    facts: ModelFacts, links: Links, plan: ParallelPlan, samples: int, accumulate: int = 1
) -> StepTime:
    """Seconds of one optimizer step of ``plan`` with ``samples`` per replica per batch.

    Args:
        facts: the model, measured with its unit times (``measure_model(..., time_sizes=...)``).
        links: latency and bandwidth between ranks and to the host.
        plan: a pipeline plan (``ParallelPlan("pipeline", devices, ...)``).
        samples: one replica's batch (split into the plan's micro-batches).
        accumulate: batches per optimizer step (the schedule runs once per batch).

    Raises:
        ValueError: the facts hold no unit times, or the plan is not a pipeline plan.

    Example::

        step_time(measure_model(model, batch, time_sizes=(2, 8)), links, plan, samples=16).seconds
    """
    times = facts.times
    if times is None:
        raise ValueError("these facts hold no unit times: measure_model(..., time_sizes=(small, large))")
    if plan.strategy != "pipeline":
        raise ValueError(f"the time model takes PipelineStrategy plans, got strategy={plan.strategy!r}")
    costs = stage_costs(facts, plan, samples)
    p, style = plan.pipeline_size, placement(plan.schedule)
    rank_of = {c.index: stage_rank(c.index, p, len(costs), style) for c in costs}
    ledgers = [
        _ledger(facts, links, plan, [c for c in costs if rank_of[c.index] == r], r, samples) for r in range(p)
    ]
    for ledger in ledgers:
        for technique in TECHNIQUES:
            technique.time(ledger)
    stages = sorted((s for ledger in ledgers for s in _stage_times(ledger)), key=lambda s: s.index)
    actions = rank_actions(plan.schedule, p, plan.stages_per_rank, plan.num_microbatches)
    gathers = [ledger.start for ledger in ledgers]
    overhead, piped = links.overhead, p > 1
    action = overhead.action(piped)
    sim = simulate(
        actions,
        lambda a: _duration(stages[a.stage], a.kind) * overhead.compute + action,
        lambda a: links.send(stages[a.stage - 1 if a.kind == "F" else a.stage].send),
        rank_of.__getitem__,
        gathers,
    )
    tails = [_tail(ledger) for ledger in ledgers]
    fixed = overhead.step() + accumulate * overhead.batch(piped)  # (every rank pays it at the step's end)
    ends = [accumulate * sim.finish[r] + tails[r][0] + fixed for r in range(p)]
    last = max(range(p), key=lambda r: (ends[r], sim.busy[r]))
    busiest = max(range(p), key=lambda r: sim.busy[r])
    m = plan.num_microbatches * accumulate
    mine = [s for s in stages if rank_of[s.index] == busiest]
    return StepTime(
        seconds=ends[last],
        schedule=accumulate * sim.makespan,
        bubble=sim.bubble,
        imbalance=sim.imbalance,
        communication=accumulate * (gathers[busiest] + sim.waited[busiest]) + tails[last][1]
        + m * sum(s.share("communication") for s in mine),
        recompute=m * sum(s.share("recompute") for s in mine),
        offload=m * sum(s.share("offload") for s in mine) + tails[last][2],
        optimizer=tails[last][3],
        overhead=fixed + accumulate * len(actions[last]) * action,
    )  # fmt: skip


def _ledger(
    facts: ModelFacts, links: Links, plan: ParallelPlan, local: list[StageCosts], rank: int, samples: int
) -> TimeLedger:
    """A rank's ledger before the techniques: its stages' measured compute, its plain optimizer step."""
    mb = samples / plan.num_microbatches
    times = facts.times
    assert times is not None  # (step_time checked it)
    keys = list(dict.fromkeys(k for c in local for k in c.param_keys))
    trainable = [facts.tensors[k] for k in keys if facts.tensors[k].grad]
    grads = sum(facts.tensors[k].grad for k in keys)
    elements = sum(t.numel for t in trainable)
    ledger = TimeLedger(plan, facts, links, rank, local, keys, mb, gradients=grads, unreduced=grads,
                        step_elements=elements, step_tensors=len(trainable))  # fmt: skip
    for c in local:
        names = ([BEFORE] if c.index == 0 else []) + c.units
        ledger.forward[c.index] = sum(times.unit(n).forward.at(mb) for n in names)
        ledger.backward[c.index] = sum(times.unit(n).backward.at(mb) for n in names)
    return ledger


def _stage_times(ledger: TimeLedger) -> list[StageTime]:
    """Each of the rank's stages' seconds per micro-batch (see the module's point 1)."""
    facts, mb = ledger.facts, ledger.micro_batch
    return [
        StageTime(c.index, ledger.forward[c.index], ledger.backward[c.index],
                  facts.probe.unit(c.units[-1]).outputs.at(mb) if c.units else 0,
                  ledger.shares.get(c.index, {}))
        for c in ledger.stages
    ]  # fmt: skip


def _duration(stage: StageTime, kind: str) -> float:
    if kind == "F":
        return stage.forward
    if kind in ("I", "W"):  # a split backward: half for the input's gradient, half for the weights'
        return stage.backward / 2
    return stage.backward


def _tail(ledger: TimeLedger) -> tuple[float, float, float, float]:
    """After the schedule: ``(seconds, of which communication, offload, optimizer step)``; the optimizer
    step on the device unless a technique priced it elsewhere."""
    step = ledger.tail.get("optimizer")
    if step is None:
        step = ledger.times.step.of(ledger.step_elements, ledger.step_tensors)
    step += ledger.step_extra  # (wherever it steps: on FSDP2's DTensor shards)
    comm, offload = ledger.tail["communication"], ledger.tail["offload"]
    return comm + offload + step, comm, offload, step
