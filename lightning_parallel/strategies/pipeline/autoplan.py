"""``PipelineStrategy(plan="auto")``: the planner picks the plan on rank 0, every rank runs it.

Lightning glue around :mod:`lightning_parallel.planner` (the search, the memory and time models); what
it measures on the job's ranks before it chooses is :mod:`.auto_measure`'s:

1. **At** ``setup_environment`` (before the callbacks' and the module's ``setup``): the budget is
   checked (``memory`` given, or read from the accelerator: a CPU has none to read) and, with a
   ``global_batch_size``, a :class:`~lightning_parallel.GradientAccumulationScheduler` for it is added
   to the Trainer's callbacks unless one is there already (the same global batch, or an error): it
   computes the accumulation from the real per-replica batch and the chosen plan's replicas at train
   start, as it does for any plan given by hand. The device mesh waits for the plan.
2. **At** ``setup``, before the split, on every rank: the links of the job's own group are timed (each
   collective, a send and a host copy at several message sizes, and a collective beside compute), then
   what every step pays whatever the plan (a trivial stage run by the strategy's own step,
   :func:`~lightning_parallel.strategies.pipeline.trials.measure_overhead`); every rank measures the whole
   model on the first training batch at once (its units timed as they will run, every rank busy), and
   the techniques measure what their time needs in place (FSDP2 on a block, tensor parallelism on a
   split block: :mod:`lightning_parallel.planner.in_place`); then the model itself runs through the
   strategy's step as replicas (one stage per rank, one micro-batch) at two accumulation windows and as
   a pipeline of two ranks at two micro-batch counts, taking turns
   (:func:`~lightning_parallel.strategies.pipeline.auto_measure.models_as_run`): what a batch and a step
   take as run beyond the prediction (:func:`~lightning_parallel.planner.calibration.as_run`), and what
   a pipeline's forwards, backwards and batches pay more
   (:func:`~lightning_parallel.planner.calibration.pipelined_as_run`), go into every plan's time. Then
   global rank 0 alone searches, sizes and times every plan and chooses the fastest that fits (with the
   safety margin);
   :func:`~lightning_parallel.distributed.agree.decide_on` hands the choice, or the error ("nothing
   fits", with what would), to every rank. With ``trials=k`` the ``k`` fastest predicted plans that fit
   are run for a few steps each on the job's ranks (:mod:`~lightning_parallel.strategies.pipeline.trials`)
   and the fastest measured is kept. The strategy then runs exactly ``PipelineStrategy.from_plan(choice)``'s
   plan (with the options given beside ``plan="auto"`` that the search leaves alone), and global rank 0
   prints the choice and the next ones with their reasons (and the trials, predicted beside measured).

The measurement leaves the model, its buffers and the random state as they were, so an auto-planned
run computes what the same plan given by hand computes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel._table import format_table
from lightning_parallel.distributed.agree import decide_on, failing_together
from lightning_parallel.layout.mesh import PipelineMesh, build_mesh
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.advice import choose
from lightning_parallel.planner.links import Link, Links
from lightning_parallel.planner.quantities import host_memory, parse_bytes
from lightning_parallel.planner.ranking import (
    MARGIN,
    Budget,
    Candidate,
    format_choice,
    format_plan,
    plan_search,
)
from lightning_parallel.planner.search import SEARCHED_FIELDS, Search
from lightning_parallel.strategies.pipeline.auto_measure import (
    Measurement,
    job_links,
    links_as_run,
    measure_everywhere,
    models_as_run,
)
from lightning_parallel.strategies.pipeline.call_input import first_batch
from lightning_parallel.strategies.pipeline.options import PLAN_OPTIONS
from lightning_parallel.strategies.pipeline.trials import (
    Meshes,
    Trial,
    host_tensors,
    run_trials,
)
from lightning_parallel.techniques.offload.disk_rate import disk_bandwidth

AUTO = "auto"
SEARCHED = SEARCHED_FIELDS
"""Plan options the search decides (or, for ``compile`` and ``partition``, leaves at their default): the
plan's core ones and each technique's (``Technique.searched``)."""

AUTO_ARGUMENT_DOCS = """\
        plan: ``"auto"``: the planner chooses the plan (the options above that it searches are then
            not given): on global rank 0, before the split, it measures the model on the first
            training batch, sizes and times every plan the devices allow, and runs the fastest whose
            fullest rank fits ``memory`` less a 10% margin; ``strategy.parallel_plan`` is the choice,
            printed on rank 0 with the next ones and why. See ``docs/planner.md``.
        memory: the device memory per rank for ``plan="auto"`` (``"24GiB"`` or bytes; default: the
            accelerator's own; required on the CPU).
        host_memory: the host memory of one node, shared by its ranks, for ``plan="auto"`` (default:
            this machine's RAM).
        disk_memory: with ``plan="auto"`` and ``offload_dir``, the disk room of one node under
            ``offload_dir`` (default: its free space there). ``offload_dir`` with ``plan="auto"`` lets the
            search keep the optimizer state in files there (``offload_to="disk"``, its bandwidth measured
            there once), chosen only where neither the device nor the host holds it.
        global_batch_size: samples per optimizer step for ``plan="auto"``; a
            ``GradientAccumulationScheduler(global_batch_size=...)`` makes it up from the dataloader's
            batch and the chosen plan's replicas (default: no accumulation, plans compared per sample).
        trials: for ``plan="auto"``, run the ``trials`` fastest predicted plans that fit for a few steps
            each on the job's ranks (each built on a copy of the model as the strategy builds its plan)
            and keep the fastest measured; rank 0 prints predicted and measured side by side (default:
            off, the fastest predicted is kept; an int >= 2 turns it on)."""


@dataclass(frozen=True)
class AutoRequest:
    """What ``plan="auto"`` was given: the budgets, the global batch, and the options kept on the choice."""

    memory: int | None = None
    host_memory: int | None = None
    global_batch_size: int | None = None
    margin: float = MARGIN
    kept: Mapping[str, Any] = field(default_factory=dict)
    trials: int = 1
    disk_memory: int | None = None
    offload_dir: str | None = None


MEASURE = Measurement()
"""What the job measures (this process's; a test replaces it in its ranks)."""


@dataclass(frozen=True)
class AutoPlanned:
    """What ``plan="auto"`` weighed, on global rank 0 (``strategy.planned``; ``None`` on the other ranks):
    every plan sized and timed (fastest first), the budget, the links, the trials (predicted beside
    measured; empty without ``trials``), what the techniques measured in place.

    Example::

        planned = trainer.strategy.planned
        if planned is not None:
            print([(c.plan.label(), c.seconds) for c in planned.candidates[:3]])
    """

    candidates: list[Candidate]
    budget: Budget
    links: Links
    trials: list[Trial] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the techniques measured in place, or why not


def auto_request(
    plan: Any, memory: Any, host_memory: Any, global_batch_size: Any, given: ParallelPlan, trials: Any = None,
    disk_memory: Any = None, offload_dir: Any = None,
) -> AutoRequest | None:  # fmt: skip
    """Check ``plan="auto"``'s arguments (``None`` without it); ``given``: the plan of the other options
    (under ``plan="auto"`` without ``offload_dir``: :func:`searched_dir` held it out for the search).

    Raises:
        ValueError: ``plan`` is not ``"auto"``, a searched option is given with it, or an auto option
            without it; a size that cannot be read.

    Example::

        >>> auto_request("auto", "24GiB", None, 256, ParallelPlan()).memory
        25769803776
    """
    default = ParallelPlan()
    options = {k: getattr(given, k) for k in PLAN_OPTIONS if getattr(given, k) != getattr(default, k)}
    extras = {"memory": memory, "host_memory": host_memory, "global_batch_size": global_batch_size,
              "trials": trials, "disk_memory": disk_memory}  # fmt: skip
    if plan is None:
        given = [k for k, v in extras.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: only for plan='auto': pass plan='auto' too, or leave them out"
            )
        return None
    if plan != AUTO:
        raise ValueError(
            f"plan must be 'auto' (or left out), got {plan!r}: use PipelineStrategy.from_plan(plan)"
        )
    searched = sorted(k for k in SEARCHED if k in options)
    if searched:
        raise ValueError(
            f"plan='auto' chooses {', '.join(searched)}: leave them out, or give the whole plan by hand "
            f"(python -m lightning_parallel.planner prints it)"
        )
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    if trials is not None and (not isinstance(trials, int) or isinstance(trials, bool) or trials < 1):
        raise ValueError(
            f"trials must be the number of predicted plans to run (an int >= 2; 1: none), got {trials!r}"
        )
    if disk_memory is not None and offload_dir is None:
        raise ValueError(
            f"disk_memory={disk_memory!r} is the room under offload_dir, which is not given: pass "
            f"offload_dir (a directory on a local disk) too, or leave disk_memory out"
        )
    sizes = {k: parse_bytes(extras[k]) if extras[k] is not None else None
             for k in ("memory", "host_memory", "disk_memory")}  # fmt: skip
    return AutoRequest(sizes["memory"], sizes["host_memory"], global_batch_size, kept=dict(options),
                       trials=trials or 1, disk_memory=sizes["disk_memory"],
                       offload_dir=None if offload_dir is None else os.fspath(offload_dir))  # fmt: skip


def searched_dir(plan: Any, options: dict[str, Any]) -> Any:
    """Under ``plan="auto"``, ``offload_dir`` taken out of the strategy's ``options`` (the search offers
    the disk tier there; the plan it chooses carries it); else None, the options as they are.

    Example::

        >>> options = {"offload_dir": "/nvme"}
        >>> searched_dir("auto", options), options
        ('/nvme', {'offload_dir': None})
    """
    if plan != AUTO:
        return None
    directory, options["offload_dir"] = options.get("offload_dir"), None
    return directory


def environment_mesh(strategy: Any) -> PipelineMesh | None:
    """At ``setup_environment``: the mesh of the given plan; under ``plan="auto"`` none yet (it waits for
    the choice at ``setup``), the budget checked and the global batch's scheduler in place."""
    if strategy._auto is None:
        return job_mesh(strategy)
    module = strategy._lightning_module
    if module is not None and module._trainer is not None:
        prepare(strategy, module.trainer)
    return None


def prepare(strategy: Any, trainer: pl.Trainer) -> None:
    """At ``setup_environment``: the device budget is known, the global batch has its scheduler."""
    import lightning_parallel  # the public callback (the callbacks package imports the strategies)

    request: AutoRequest = strategy._auto
    if request.memory is None:
        device_memory(strategy.root_device)  # (raises on a CPU with the fix)
    scheduler = lightning_parallel.GradientAccumulationScheduler
    schedulers = [c for c in trainer.callbacks if isinstance(c, scheduler)]
    wanted = request.global_batch_size
    if wanted is None:
        return
    for s in schedulers:
        sizes = set((s.global_batch_size or {}).values())
        if sizes != {wanted}:
            raise ValueError(
                f"PipelineStrategy(plan='auto', global_batch_size={wanted}) and the Trainer's "
                f"GradientAccumulationScheduler ({s.global_batch_size or s.scheduling}) disagree: give the "
                f"global batch in one place"
            )
    if not schedulers:
        trainer.callbacks.append(scheduler(global_batch_size=wanted))


def device_memory(device: torch.device) -> int:
    """The accelerator's memory (``torch.cuda.get_device_properties``), or an error saying what to pass."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    raise ValueError(
        f"PipelineStrategy(plan='auto') needs the memory of each device, which a {device.type} device does "
        f"not report: pass memory= (e.g. PipelineStrategy(plan='auto', memory='24GiB'))"
    )


def decide(strategy: Any, trainer: pl.Trainer) -> None:
    """At ``setup``, on every rank: the plan chosen on rank 0 (or measured fastest of the trials) becomes
    ``strategy.parallel_plan``; its mesh."""
    request: AutoRequest = strategy._auto
    device, settings = strategy.root_device, MEASURE
    meshes = Meshes(device.type)
    budget = Budget(
        request.memory or device_memory(device),
        request.host_memory or host_memory(),
        trainer.num_devices,
        request.margin,
        request.disk_memory or _disk_room(request.offload_dir),
    )
    planned: list[AutoPlanned] = []  # (rank 0's)
    with torch.random.fork_rng(devices=_rng_devices(device)):
        links = job_links(trainer, meshes, settings)
        facts, search, notes = measure_everywhere(
            strategy, trainer, budget, settings, request.global_batch_size, request.offload_dir
        )
        if request.offload_dir is not None:
            with failing_together():  # (a bad directory: every rank's error, before any step)
                links = replace(links, disk=Link(0.0, disk_bandwidth(request.offload_dir)))
        run = models_as_run(strategy, trainer, facts, budget, meshes, settings)
        links = decide_on(0, lambda: links_as_run(links, facts, run, notes))
        plan, report, top = decide_on(
            0, lambda: _choose(facts, search, budget, links, request, notes, planned)
        )
        rank_zero_info(report)
        if len(top) > 1:
            batch = strategy.batch_to_device(first_batch(trainer))
            tried = run_trials(trainer, strategy.lightning_module, top, batch, meshes, settings.trial_steps)
            plan, report = decide_on(0, lambda: _best_measured(tried, plan))
            rank_zero_info(report)
            planned = [replace(p, trials=tried) for p in planned]
    strategy.planned = planned[0] if planned else None
    strategy.parallel_plan = plan.for_devices(strategy.world_size)  # label() and code() work in a hook
    strategy._mesh = meshes.of(strategy.layout, host_tensors(strategy.parallel_plan, device))


def job_mesh(strategy: Any) -> PipelineMesh:
    """The device mesh of the strategy's plan, every role's group (a collective); its groups take host
    tensors where the plan's techniques bring them to collectives (``Environment.host_backend``)."""
    host = host_tensors(strategy.parallel_plan, strategy.root_device)
    return build_mesh(strategy.root_device.type, strategy.layout, host)


def _choose(
    facts: dict[int, Any],
    search: Search,
    budget: Budget,
    links: Links,
    request: AutoRequest,
    notes: list[str],
    planned: list[AutoPlanned],
) -> tuple[ParallelPlan, str, list[Trial]]:
    """On rank 0: every plan sized and timed (kept in ``planned``), the fastest that fits, the report; the
    plans to try."""
    candidates = plan_search(facts, search, links)
    planned.append(AutoPlanned(candidates, budget, links, notes=list(notes)))
    best = choose(facts, search, budget, links, candidates)
    plan = _with_kept(best.plan, request)
    top = []
    if request.trials > 1:
        fits = [c for c in candidates if budget.fits(c)][: request.trials]
        top = [Trial(_trial_plan(c, request, search.devices), c.seconds, c.samples) for c in fits]
    return plan, _report(candidates, best, budget, search, links, notes), top


def _with_kept(plan: ParallelPlan, request: AutoRequest) -> ParallelPlan:
    """The strategy's plan: the search's choice with the options given beside ``plan="auto"``."""
    return ParallelPlan("pipeline", **(plan.strategy_arguments() | dict(request.kept)))


def _trial_plan(c: Candidate, request: AutoRequest, devices: int) -> ParallelPlan:
    """What a trial runs: the strategy's plan on the job's devices, accumulating as the candidate does."""
    plan = _with_kept(c.plan, request).for_devices(devices)
    return replace(plan, accumulate_grad_batches=c.accumulate)


def _best_measured(tried: list[Trial], predicted: ParallelPlan) -> tuple[ParallelPlan, str]:
    """On rank 0: the trial with the least measured time per sample (none ran: the predicted choice)."""
    ran = [t for t in tried if t.measured is not None]
    best = min(ran, key=lambda t: t.per_sample) if ran else None
    rows = [
        [t.plan.label(), f"{t.predicted * 1e3:.1f} ms",
         f"{t.measured * 1e3:.1f} ms" if t.measured is not None else f"failed: {t.error}",
         f"{t.measured / t.predicted:.2f}" if t.measured is not None and t.predicted > 0 else "-",
         "<- chosen" if t is best else ""]
        for t in tried
    ]  # fmt: skip
    table = format_table(["plan", "predicted step", "measured step", "measured / predicted", ""], rows)
    warmup, timed = MEASURE.trial_steps
    head = (f"PipelineStrategy(plan='auto', trials={len(tried)}): the fastest predicted plans that fit, each "
            f"run {warmup} + {timed} steps on the job's ranks")  # fmt: skip
    if best is None:
        return predicted, f"{head}\n{table}\nno trial ran: the fastest predicted plan runs"
    rank = tried.index(best) + 1
    verdict = "the fastest predicted" if rank == 1 else f"ranked {rank} of {len(tried)} by prediction"
    return best.plan, f"{head}\n{table}\nchosen: {best.plan.label()} (the fastest measured; {verdict})"


def _disk_room(directory: str | None) -> int | None:
    """The free bytes under ``offload_dir`` (the default disk budget), or None without one (or where it
    does not exist: its check then fails on every rank, with the fix)."""
    if directory is None or not os.path.isdir(directory):
        return None
    return shutil.disk_usage(directory).free


def _rng_devices(device: torch.device) -> list[Any]:
    return [device] if device.type == "cuda" else []


def _report(
    candidates: list[Candidate],
    best: Candidate,
    budget: Budget,
    search: Search,
    links: Links,
    notes: list[str] = (),  # type: ignore[assignment]
) -> str:
    shown = candidates[:8] if best in candidates[:8] else [*candidates[:7], best]
    measured = f"; {', '.join(notes)}" if notes else ""
    return (
        f"PipelineStrategy(plan='auto'): {len(candidates)} plans on {search.devices} devices, budget "
        f"{budget.describe()}; {links.describe()}{measured}\n{format_plan(shown, budget)}\n"
        f"{format_choice(candidates, budget)}"
    )
