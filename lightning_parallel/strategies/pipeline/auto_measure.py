"""What ``plan="auto"`` measures on the job's ranks before it chooses (every rank calls each function).

The links of the job's group and what every step pays (:func:`job_links`), the model's facts at each
tensor-parallel size and the techniques' in-place measurements (:func:`measure_everywhere`), the model run
as replicas through the strategy's own step (:func:`replicas_as_run`) and what that run sets in the links
(:func:`links_as_run`, on rank 0). The choice among the plans is :mod:`.autoplan`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._pytree import tree_map

from lightning_parallel.data.batch_samples import samples_in
from lightning_parallel.distributed.agree import decide_on, distributed_ready, failing_together
from lightning_parallel.distributed.link_timing import REPEATS, SIZES, time_copy, time_group
from lightning_parallel.pipeline.step_logs import LogRecorder
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.calibration import as_run, pipelined_as_run
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.in_place import measure_in_place
from lightning_parallel.planner.links import Links, StepOverhead, given_links, links_from
from lightning_parallel.planner.ranking import Budget, measure_for
from lightning_parallel.planner.search import Search
from lightning_parallel.planner.time_model import step_time
from lightning_parallel.strategies.pipeline.call_input import first_batch
from lightning_parallel.strategies.pipeline.lightning_loop import loop_seconds
from lightning_parallel.strategies.pipeline.trials import (
    Meshes,
    measure_overhead,
    optimizers_without_trainer,
    slowest,
    time_runs,
)


@dataclass(frozen=True)
class Measurement:
    """How much ``plan="auto"`` measures on the job before it chooses (what the tests make tiny).

    Args:
        link_sizes, link_repeats: the message sizes (bytes) each collective is timed at, and the
            repeats of each (the median kept).
        repeats: the timed runs of each unit and of each in-place measurement.
        overhead_steps: (warm-up, timed) steps of each trivial-stage run that measures what every step
            pays, and of each window of the model's own run as replicas; ``(0, 0)``: neither measured.
        trial_steps: (warm-up, timed) optimizer steps of each plan ``trials`` runs.

    Example::

        autoplan.MEASURE = autoplan.Measurement(link_sizes=(1024, 65536), link_repeats=1, repeats=1,
                                                overhead_steps=(1, 1), trial_steps=(1, 1))   # a test's
    """

    link_sizes: tuple[int, ...] = SIZES
    link_repeats: int = REPEATS
    repeats: int = 3
    overhead_steps: tuple[int, int] = (2, 5)
    trial_steps: tuple[int, int] = (2, 5)


def job_links(trainer: pl.Trainer, meshes: Meshes, settings: Measurement) -> Links:
    """The links of the job's own group (every rank calls it: each collective timed at several sizes), or
    free ones for a job of one rank; with what every step pays, measured on a trivial stage, and what
    Lightning's loop around the step adds (:func:`.lightning_loop.loop_seconds`, the slowest rank's)."""
    device = trainer.strategy.root_device
    timings = time_group(sizes=settings.link_sizes, repeats=settings.link_repeats, device=device)
    if timings is None:
        copy = time_copy(1 << 24, device)
        links = given_links(bandwidth=1e12, host_bandwidth=(1 << 24) / max(copy, 1e-9), source="one rank")
    else:
        links = links_from(timings)
    if settings.overhead_steps[1] < 1:
        return links
    overhead = measure_overhead(trainer, links, meshes, settings.overhead_steps)
    warmup, timed = settings.overhead_steps
    step, batch = (slowest(s) for s in loop_seconds((warmup + 3, 4 * timed)))
    return replace(links, overhead=replace(overhead, loop_step=step, loop_batch=batch))


def measure_everywhere(
    strategy: Any, trainer: pl.Trainer, budget: Budget, settings: Measurement, global_batch_size: int | None,
    offload_dir: str | None,
) -> tuple[dict[int, Any], Search, list[str]]:  # fmt: skip
    """On every rank at once (the ranks share the machine as the steps will): the model measured on the
    first training batch, then the techniques' measurements in place; an error on any rank is every
    rank's."""
    module = strategy.lightning_module
    with failing_together():
        batch = strategy.batch_to_device(first_batch(trainer))
        samples = samples_in(batch) or 1
        search = Search(
            strategy.world_size, global_batch_size, samples, trainer.precision,
            tensor_parallel_sizes=_tensor_parallel_sizes(strategy.world_size), offload=True,
            ranks_per_node=trainer.num_devices, offload_parameters=strategy.root_device.type == "cpu",
            offload_dir=offload_dir,
        )  # fmt: skip
        with LogRecorder().recording(module, samples), _on_device(module, strategy.root_device, budget):
            optimizers = optimizers_without_trainer(module)
            facts = _facts_at_each_size(module, batch, search, optimizers, settings.repeats)
    search = replace(search, tensor_parallel_sizes=tuple(facts))
    notes = measure_in_place(module, facts, strategy.root_device, settings.repeats, optimizers)
    return facts, search, notes


def _facts_at_each_size(
    module: Any, batch: Any, search: Search, optimizers: list[Any], repeats: int = 3
) -> dict[int, Any]:
    """The facts at each tensor-parallel size the model can be split at (a size it refuses is skipped),
    the ranks lined up before each timed run."""
    out = {}
    for tp in search.tensor_parallel_sizes:
        try:
            out |= measure_for(module, batch, replace(search, tensor_parallel_sizes=(tp,)), optimizers,
                               sync=_barrier, repeats=repeats)  # fmt: skip
        except ValueError:
            if tp == 1:
                raise
    return out


AS_RUN_WINDOWS = (1, 3)
"""The accumulation windows (batches per optimizer step) the job's own model is run at as replicas by
:func:`models_as_run`: their difference is what a batch takes as run."""

PIPELINED_MICROBATCHES = (2, 8)
"""The micro-batch counts (the second capped at the batch's samples) the job's own model is run at as a
pipeline of two ranks by :func:`models_as_run`: their difference is what more forwards and backwards pay
pipelined."""


@dataclass(frozen=True)
class AsRun:
    """The job's own model run by the strategy's step (:func:`models_as_run`): as replicas at two
    accumulation windows ``{batches per step: seconds per step}``, and as a pipeline of two ranks at two
    micro-batch counts ``{micro-batches: seconds per step}`` (None where it could not run), on ``samples``
    a batch; ``seconds``: what measuring it took."""

    samples: int
    replicas: ParallelPlan
    windows: dict[int, float]
    pipeline: ParallelPlan | None = None
    counts: dict[int, float] | None = None
    seconds: float = 0.0


def models_as_run(
    strategy: Any, trainer: pl.Trainer, facts: dict[int, Any], budget: Budget, meshes: Meshes,
    settings: Measurement,
) -> AsRun | None:  # fmt: skip
    """On every rank: the job's own model run by the strategy's step on the first training batch (or its
    first half, quarter, ... where the replicas' predicted peak would not fit the budget), as replicas
    (one stage per rank, one micro-batch) at each window of :data:`AS_RUN_WINDOWS` and, where the ranks
    pair up, the batch holds both counts and the plans fit, as a pipeline of two ranks (1F1B, one stage
    per rank) at each count of :data:`PIPELINED_MICROBATCHES`, one batch a step; all the runs taking turns
    step by step, so that a load that drifts meets them alike. None where it was not measured
    (``overhead_steps`` off, an untimed model, nothing fits, a failure)."""
    mine, world = facts[1], strategy.world_size
    if settings.overhead_steps[1] < 1 or mine.times is None:
        return None
    replicas = ParallelPlan("pipeline", world, 1, 1)
    batch = strategy.batch_to_device(first_batch(trainer))
    samples = decide_on(0, lambda: _samples_that_fit(mine, replicas, samples_in(batch) or 1, budget))
    if samples is None:
        return None
    first = tree_map(lambda t: t[:samples] if torch.is_tensor(t) and t.dim() > 0 else t, batch)
    low, high = PIPELINED_MICROBATCHES[0], min(PIPELINED_MICROBATCHES[1], 1 << (samples.bit_length() - 1))
    pipelines = [ParallelPlan("pipeline", world, 2, m) for m in (low, high)]
    if (
        world % 2
        or high <= low
        or samples % high
        or not decide_on(
            0, lambda: all(predict(mine, p, samples=samples).peak <= budget.usable for p in pipelines)
        )
    ):
        pipelines = []
    runs = [(replicas, w) for w in AS_RUN_WINDOWS] + [(p, 1) for p in pipelines]
    module, device, start = strategy.lightning_module, strategy.root_device, time.perf_counter()
    with _on_device(module, device, budget):
        seconds = time_runs(trainer, module, runs, first, meshes, settings.overhead_steps)
    if seconds is None and pipelines:  # (the pipeline's split failed: the replicas alone)
        runs, pipelines = runs[: len(AS_RUN_WINDOWS)], []
        with _on_device(module, device, budget):
            seconds = time_runs(trainer, module, runs, first, meshes, settings.overhead_steps)
    if seconds is None:
        return None
    windows = dict(zip(AS_RUN_WINDOWS, seconds))
    counts = dict(zip((low, high), seconds[len(AS_RUN_WINDOWS) :])) if pipelines else None
    took = time.perf_counter() - start
    return AsRun(samples, replicas, windows, pipelines[0] if pipelines else None, counts, took)


def _samples_that_fit(facts: Any, plan: ParallelPlan, samples: int, budget: Budget) -> int | None:
    """The most samples, halving from ``samples``, at which ``plan``'s predicted peak fits the budget."""
    while samples >= 1:
        if predict(facts, plan, samples=samples).peak <= budget.usable:
            return samples
        samples //= 2
    return None


def links_as_run(links: Links, facts: dict[int, Any], run: AsRun | None, notes: list[str]) -> Links:
    """On rank 0: the links with what the replicas' run measured (:func:`as_run`), then what the pipeline's
    run measured beyond that (:func:`pipelined_as_run`), each if it ran; a note each."""
    if run is None:
        return links
    links = _replicas_links(links, facts, run, notes)
    if run.pipeline is None or run.counts is None:
        return links
    plan, samples, measured = run.pipeline, run.samples, run.counts
    overhead = pipelined_as_run(facts[1], links, plan, samples, measured)
    predicted = [
        step_time(facts[1], links, replace(plan, num_microbatches=m), samples).seconds for m in measured
    ]
    steps = ", ".join(f"m={m} {t * 1e3:.1f} ms (predicted {p * 1e3:.1f})"
                      for (m, t), p in zip(measured.items(), predicted))  # fmt: skip
    notes.append(
        f"the model run as a pipeline of 2 ranks on {samples} samples ({steps}; both runs {run.seconds:.1f} "
        f"s): {overhead.pipelined_action * 1e3:+.2f} ms per forward or backward and "
        f"{overhead.pipelined_batch * 1e3:+.1f} ms per batch on several pipeline ranks"
    )
    return replace(links, overhead=overhead)


def _replicas_links(links: Links, facts: dict[int, Any], run: AsRun, notes: list[str]) -> Links:
    plan, samples, measured = run.replicas, run.samples, run.windows
    overhead = as_run(facts[1], links, plan, samples, measured)
    steps = ", ".join(f"{w} batches {t * 1e3:.1f} ms" for w, t in sorted(measured.items()))
    lines = step_time(facts[1], replace(links, overhead=StepOverhead()), plan, samples).schedule
    notes.append(
        f"the model run as replicas on {samples} samples a batch ({steps} a step, its stages "
        f"{lines * 1e3:.1f} ms by the facts' lines): its stages as "
        f"run {overhead.compute:.2f}x their units' timed sum, "
        f"{(overhead.per_step - links.overhead.per_step) * 1e3:+.1f} ms a step"
    )
    return replace(links, overhead=overhead)


@contextlib.contextmanager
def _on_device(module: Any, device: torch.device, budget: Budget) -> Iterator[None]:
    """The model on the job's accelerator while it is timed there, if a quarter of the budget holds it
    (parameters, gradients and twice as much state); else timed where it is (the CPU), said so."""
    home = next((p.device for p in module.parameters()), device)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    if device.type == home.type or home.type == "meta":
        yield
        return
    if 4 * weights > budget.usable // 4:
        rank_zero_info(f"PipelineStrategy(plan='auto'): the model does not fit one {device.type} device "
                       f"to be timed: its units are timed on the {home.type}")  # fmt: skip
        yield
        return
    module.to(device)
    try:
        yield
    finally:
        module.to(home)


def _tensor_parallel_sizes(world: int) -> tuple[int, ...]:
    return (1, 2) if world >= 2 and world % 2 == 0 else (1,)


def _barrier() -> None:
    if distributed_ready():
        dist.barrier()
