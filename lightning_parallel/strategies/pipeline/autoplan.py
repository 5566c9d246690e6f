"""``PipelineStrategy(plan="auto")``: the planner picks the plan on rank 0, every rank runs it.

Lightning glue around :mod:`lightning_parallel.memory` (the search, the memory and time models):

1. **At** ``setup_environment`` (before the callbacks' and the module's ``setup``): the budget is
   checked (``memory`` given, or read from the accelerator: a CPU has none to read) and, with a
   ``global_batch_size``, a :class:`~lightning_parallel.GradientAccumulationScheduler` for it is added
   to the Trainer's callbacks unless one is there already (the same global batch, or an error): it
   computes the accumulation from the real per-replica batch and the chosen plan's replicas at train
   start, as it does for any plan given by hand. The device mesh waits for the plan.
2. **At** ``setup``, before the split: every rank times the links of the job's own group (an all-reduce
   and a send of two sizes) and its host copies; then global rank 0 alone measures the whole model on
   the first training batch (as its dataloader yields it: one replica's batch), times its units,
   searches, sizes and times every plan, and chooses the fastest that fits (with the safety margin);
   :func:`~lightning_parallel.distributed.agree.decide_on` hands the choice, or the error ("nothing
   fits", with what would), to every rank. The strategy then runs exactly
   ``PipelineStrategy.from_plan(choice)``'s plan (with the options given beside ``plan="auto"`` that
   the search leaves alone), and global rank 0 prints the choice and the next ones with their reasons.

The measurement leaves the model, its buffers and the random state as they were, so an auto-planned
run computes what the same plan given by hand computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.data.batch_samples import samples_in
from lightning_parallel.distributed.agree import decide_on
from lightning_parallel.distributed.link_timing import time_copy, time_group
from lightning_parallel.layout.mesh import PipelineMesh, build_mesh
from lightning_parallel.memory.advice import choose
from lightning_parallel.memory.links import Links, given_links, links_from
from lightning_parallel.memory.optimizer import optimizers_from
from lightning_parallel.memory.planner import (
    MARGIN,
    Budget,
    Candidate,
    format_choice,
    format_plan,
    measure_for,
    plan_search,
)
from lightning_parallel.memory.quantities import host_memory, parse_bytes
from lightning_parallel.memory.search import SEARCHED_FIELDS, Search
from lightning_parallel.pipeline.step_logs import LogRecorder
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.strategies.pipeline.call_input import first_batch
from lightning_parallel.strategies.pipeline.options import PLAN_OPTIONS
from lightning_parallel.techniques import environment

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
        global_batch_size: samples per optimizer step for ``plan="auto"``; a
            ``GradientAccumulationScheduler(global_batch_size=...)`` makes it up from the dataloader's
            batch and the chosen plan's replicas (default: no accumulation, plans compared per sample)."""


@dataclass(frozen=True)
class AutoRequest:
    """What ``plan="auto"`` was given: the budgets, the global batch, and the options kept on the choice."""

    memory: int | None = None
    host_memory: int | None = None
    global_batch_size: int | None = None
    margin: float = MARGIN
    kept: Mapping[str, Any] = field(default_factory=dict)


def auto_request(
    plan: Any, memory: Any, host_memory: Any, global_batch_size: Any, given: ParallelPlan
) -> AutoRequest | None:
    """Check ``plan="auto"``'s arguments (``None`` without it); ``given``: the plan of the other options.

    Raises:
        ValueError: ``plan`` is not ``"auto"``, a searched option is given with it, or an auto option
            without it; a size that cannot be read.

    Example::

        >>> auto_request("auto", "24GiB", None, 256, ParallelPlan()).memory
        25769803776
    """
    default = ParallelPlan()
    options = {k: getattr(given, k) for k in PLAN_OPTIONS if getattr(given, k) != getattr(default, k)}
    extras = {"memory": memory, "host_memory": host_memory, "global_batch_size": global_batch_size}
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
            f"(python -m lightning_parallel.memory prints it)"
        )
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    sizes = {
        k: parse_bytes(v) if v is not None else None for k, v in extras.items() if k != "global_batch_size"
    }
    return AutoRequest(sizes["memory"], sizes["host_memory"], global_batch_size, kept=dict(options))


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
    """At ``setup``, on every rank: the plan chosen on rank 0 becomes ``strategy.parallel_plan``; the mesh."""
    request: AutoRequest = strategy._auto
    links = job_links(strategy.root_device)
    budget = Budget(
        request.memory or device_memory(strategy.root_device),
        request.host_memory or host_memory(),
        trainer.num_devices,
        request.margin,
    )
    with torch.random.fork_rng(devices=_rng_devices(strategy.root_device)):
        plan, report = decide_on(0, lambda: _choose(strategy, trainer, budget, links, request))
    rank_zero_info(report)
    strategy.parallel_plan = plan.for_devices(strategy.world_size)  # label() and code() work in a hook
    strategy._mesh = job_mesh(strategy)


def job_mesh(strategy: Any) -> PipelineMesh:
    """The device mesh of the strategy's plan, every role's group (a collective); its groups take host
    tensors where the plan's techniques bring them to collectives (``Environment.host_backend``)."""
    host_tensors = environment(strategy.parallel_plan, strategy.root_device).host_backend is not None
    return build_mesh(strategy.root_device.type, strategy.layout, host_tensors)


def job_links(device: torch.device) -> Links:
    """The links of the job's own group (every rank calls it), or free ones for a job of one rank."""
    timings = time_group()
    copy = time_copy(1 << 24, device)
    if timings is None:
        return given_links(bandwidth=1e12, host_bandwidth=(1 << 24) / max(copy, 1e-9), source="one rank")
    return links_from(timings, copy, 1 << 24)


def _choose(
    strategy: Any, trainer: pl.Trainer, budget: Budget, links: Links, request: AutoRequest
) -> tuple[ParallelPlan, str]:
    module = strategy.lightning_module
    batch = strategy.batch_to_device(first_batch(trainer))
    samples = samples_in(batch) or 1
    search = Search(
        strategy.world_size, request.global_batch_size, samples, trainer.precision,
        tensor_parallel_sizes=_tensor_parallel_sizes(strategy.world_size), offload=True,
        ranks_per_node=trainer.num_devices, offload_parameters=strategy.root_device.type == "cpu",
    )  # fmt: skip
    with LogRecorder().recording(module, samples), _on_device(module, strategy.root_device, budget):
        facts = _measured(module, batch, search, _optimizers(module))
    search = replace(search, tensor_parallel_sizes=tuple(facts))
    candidates = plan_search(facts, search, links)
    best = choose(facts, search, budget, links, candidates)
    plan = ParallelPlan("pipeline", **(best.plan.strategy_arguments() | dict(request.kept)))
    return plan, _report(candidates, best, budget, search, links)


def _measured(module: Any, batch: Any, search: Search, optimizers: list[Any]) -> dict[int, Any]:
    """The facts at each tensor-parallel size the model can be split at (a size it refuses is skipped)."""
    out = {}
    for tp in search.tensor_parallel_sizes:
        try:
            out |= measure_for(module, batch, replace(search, tensor_parallel_sizes=(tp,)), optimizers)
        except ValueError:
            if tp == 1:
                raise
    return out


def _optimizers(module: Any) -> list[Any]:
    """The module's optimizers, built without its Trainer (``configure_optimizers`` reading the Trainer,
    e.g. ``estimated_stepping_batches``, would set up the data before the plan decides the replicas):
    AdamW's state and step stand in when it needs the Trainer."""
    trainer, module._trainer = module._trainer, None
    try:
        found = module.configure_optimizers()
    except Exception:
        found = None
    finally:
        module._trainer = trainer
    return optimizers_from(found) or [torch.optim.AdamW(module.parameters())]


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


def _rng_devices(device: torch.device) -> list[Any]:
    return [device] if device.type == "cuda" else []


def _report(
    candidates: list[Candidate], best: Candidate, budget: Budget, search: Search, links: Links
) -> str:
    shown = candidates[:8] if best in candidates[:8] else [*candidates[:7], best]
    return (
        f"PipelineStrategy(plan='auto'): {len(candidates)} plans on {search.devices} devices, budget "
        f"{budget.describe()}; {links.describe()}\n{format_plan(shown, budget)}\n"
        f"{format_choice(candidates, budget)}"
    )
