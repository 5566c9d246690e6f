"""``plan="auto"``'s runs on the job itself: the top predicted plans tried for a few steps (``trials=k``),
what every step pays whatever the plan, measured the same way on a trivial stage, and the job's own model
run as replicas at two accumulation windows (what its stages and its step take as the strategy runs them).

A trial builds a plan exactly as the strategy builds its own (the split, the techniques, the optimizers:
``setup.py``'s functions) on a copy of the unsplit module (the split prunes the module it is given; the
user's stays whole for the next trial and for the run), and runs whole optimizer steps on the first
training batch with the strategy's own step: each batch of the accumulation window through the schedule
(:func:`~lightning_parallel.strategies.pipeline.step.run_step`: the capture, the schedule, the loss and
the logs' way back to every stage), the held gradients added, the gradient sync, the optimizers' step.
Lightning's loop around it (hooks, callbacks, the logger connector, the data: 4-6 ms on a 53 ms step
here) is not run: nothing a trial's step logs reaches the logger, and no callback sees a trial. Every
rank runs every trial; a trial that fails is left out on every rank (agreed); a step's time is the
slowest rank's median over the timed steps. Pure glue: no Lightning hook is overridden here.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import nn

from lightning_parallel.distributed.agree import agree, distributed_ready, world_size
from lightning_parallel.layout.mesh import PipelineMesh, build_mesh
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.links import Links, StepOverhead
from lightning_parallel.planner.optimizer import optimizers_from
from lightning_parallel.strategies.pipeline import setup as pipeline_setup
from lightning_parallel.strategies.pipeline.step import run_step
from lightning_parallel.strategies.pipeline.step_state import StepState
from lightning_parallel.techniques import environment
from lightning_parallel.techniques.job import buffers_to


@dataclass(frozen=True)
class Trial:
    """One plan tried: its prediction and what it measured (seconds per optimizer step), or why it failed.

    ``samples``: per optimizer step over every replica (what the plans are compared per).

    Example::

        Trial(plan, predicted=0.105, samples=16).per_sample      # nan until measured
    """

    plan: ParallelPlan
    predicted: float
    samples: int
    measured: float | None = None
    error: str | None = None

    @property
    def per_sample(self) -> float:
        return self.measured / self.samples if self.measured is not None else float("nan")


class Meshes:
    """The device meshes of the plans tried, one per rank layout and need of host tensors (every rank
    builds them in the same order): the chosen plan's is the run's, the others stay unused."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._built: dict[tuple[RankLayout, bool], PipelineMesh] = {}

    def of(self, layout: RankLayout, host: bool = False) -> PipelineMesh:
        if (layout, host) not in self._built:
            self._built[layout, host] = build_mesh(self.device_type, layout, host)
        return self._built[layout, host]


def host_tensors(plan: ParallelPlan, device: torch.device) -> bool:
    """Whether ``plan``'s techniques bring host tensors to its mesh's collectives on ``device``."""
    return environment(plan, device).host_backend is not None


def run_trials(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    trials: list[Trial],
    batch: Any,
    meshes: Meshes,
    steps: tuple[int, int],
) -> list[Trial]:
    """Each trial's plan run for ``steps`` = (warm-up, timed) optimizer steps on every rank; the trials
    with their measured seconds, or the error of one that failed (on every rank alike).

    Example::

        tried = run_trials(trainer, model, [Trial(plan, 0.1, 16) for plan in top], batch, meshes, (2, 5))
    """
    out = []
    for trial in trials:
        seconds, error = None, None
        try:
            seconds = time_plan(trainer, module, trial.plan, batch, meshes, steps)
        except Exception as err:
            error = err
        _release(trainer.strategy.root_device)  # (the trial's copy is unreachable now)
        try:
            agree(error)
        except Exception as err:
            out.append(replace(trial, error=f"{type(err).__name__}: {err}".splitlines()[0]))
            continue
        out.append(replace(trial, measured=slowest(seconds or 0.0)))
    return out


def time_plan(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    plan: ParallelPlan,
    batch: Any,
    meshes: Meshes,
    steps: tuple[int, int],
) -> float:
    """This rank's median seconds per optimizer step of ``plan`` (``plan.accumulate_grad_batches`` batches
    each) on a copy of ``module``, after ``steps[0]`` warm-up steps; every rank calls it."""
    return time_windows(trainer, module, plan, batch, meshes, steps, (plan.accumulate_grad_batches,))[0]


def time_windows(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    plan: ParallelPlan,
    batch: Any,
    meshes: Meshes,
    steps: tuple[int, int],
    windows: tuple[int, ...],
) -> list[float]:
    """:func:`time_plan` for each accumulation window of ``windows`` (batches per optimizer step), on one
    build of ``plan``; the windows take turns, step by step (a machine whose load drifts slows them alike)."""
    device = trainer.strategy.root_device
    try:
        step = _built(trainer, module, plan, batch, meshes.of(plan.layout(), host_tensors(plan, device)))
        return _median_steps([lambda i, w=w: step(i, w) for w in windows], steps, device)
    finally:
        _release(device)


def _built(
    trainer: pl.Trainer, module: pl.LightningModule, plan: ParallelPlan, batch: Any, mesh: PipelineMesh
) -> Callable[[int, int], None]:
    """``plan`` built on a copy of ``module`` as the strategy builds its own (the split, the techniques, the
    optimizers); its optimizer step: ``step(index, batches)`` runs ``batches`` batches, then the sync and
    the optimizers' step."""
    device = trainer.strategy.root_device
    trial = trial_copy(module, trainer)
    parts, read = pipeline_setup.split_module(trainer, trial, plan, mesh, device, None, _quiet)
    trainer.precision_plugin.convert_module(trial)
    trainer.precision_plugin.convert_module(parts.twin)
    if environment(plan, device).parameters_on_host:
        buffers_to(trial, device)
    else:
        trial.to(device)
    parts, job, sync = pipeline_setup.apply_techniques(plan, trial, device, parts, read, log=False)
    optimizers = optimizers_without_trainer(trial)
    _optimizers_to_device(optimizers, device)
    optimizers = pipeline_setup.transformed_optimizers(optimizers, job)

    state = StepState()  # (the trial's own: the strategy's steps keep theirs)

    def step(index: int, batches: int) -> None:
        for b in range(batches):
            run_step(parts, state, trial, "training_step", (batch, index * batches + b), train=True)
            state.held.add_to_grads()
        sync()
        for o in optimizers:
            o.step()
        for o in optimizers:
            o.zero_grad(set_to_none=True)

    return step


def _release(device: torch.device) -> None:
    """Free a trial's stages and optimizer state before the next one (they are unreachable once it returns:
    collected here, as the next trial builds)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _median_steps(
    steps_of: list[Callable[[int], None]], steps: tuple[int, int], device: torch.device
) -> list[float]:
    """Each of ``steps_of``'s median seconds per step, run in turn step by step after the warm-up ones."""
    warmup, timed = steps
    seconds: list[list[float]] = [[] for _ in steps_of]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(warmup + timed):
            for step, mine in zip(steps_of, seconds):
                _barrier()
                start = time.perf_counter()
                step(i)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                mine.append(time.perf_counter() - start)
    return [statistics.median(mine[warmup:]) for mine in seconds]


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (every rank calls it): a step ends with its slowest rank."""
    if world_size() < 2:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def trial_copy(module: pl.LightningModule, trainer: pl.Trainer) -> pl.LightningModule:
    """A deep copy of ``module`` for a trial: the same trainer (not copied), and ``self.log`` that keeps
    nothing (its class a subclass whose ``log`` does nothing: the strategy's log recorder still shadows it
    while the step runs, and its replay after the schedule reaches nothing)."""
    memo = {id(trainer): trainer}
    trial = copy.deepcopy(module, memo)
    cls = type(trial)
    trial.__class__ = type(cls.__name__, (cls,), {"log": _no_log, "__module__": cls.__module__})
    trial.trainer = trainer  # (a LightningModule's copy drops its trainer: __getstate__)
    return trial


def _no_log(self: Any, *args: Any, **kwargs: Any) -> None:
    """A trial's ``self.log``: nothing reaches the logger."""


def optimizers_without_trainer(module: pl.LightningModule) -> list[Any]:
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


# ------------------------------------------------------------------------------ what every step pays


class _Trivial(pl.LightningModule):
    """A trivial stage: two 1x1 layers, a step that logs its loss (as most steps do)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
        self.example_input_array = torch.zeros(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self(batch).sum()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def measure_overhead(
    trainer: pl.Trainer, links: Links, meshes: Meshes, steps: tuple[int, int]
) -> StepOverhead:
    """What every step pays whatever the plan, on every rank of the job (every rank calls it): a trivial
    stage (two 1x1 layers, a logged loss) run by the strategy's own step as replicas over every rank, at
    one micro-batch (one batch per step, then two), and at four; what the time model charges for it (the
    replicas' all-reduce of its four numbers) taken out.

    Example::

        overhead = measure_overhead(trainer, links, Meshes("cpu"), (2, 5))
        links = dataclasses.replace(links, overhead=overhead)
    """
    device = trainer.strategy.root_device
    trivial = _Trivial()
    trivial.trainer = trainer
    batch = torch.zeros(4, 1, device=device)
    world = world_size()

    def timed(m: int, windows: tuple[int, ...]) -> list[float]:
        plan = ParallelPlan("pipeline", world, 1, m)
        return [slowest(s) for s in time_windows(trainer, trivial, plan, batch, meshes, steps, windows)]

    (one, two), (four,) = timed(1, (1, 2)), timed(4, (1,))
    per_action = max(0.0, (four - one) / 6)  # three micro-batches more: a forward and a backward each
    per_batch = max(0.0, two - one - 2 * per_action)
    modelled = links.all_reduce(world, 4 * sum(p.numel() for p in trivial.parameters()))
    return StepOverhead(max(0.0, one - per_batch - 2 * per_action - modelled), per_batch, per_action)


def time_runs(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    runs: list[tuple[ParallelPlan, int]],
    batch: Any,
    meshes: Meshes,
    steps: tuple[int, int],
) -> list[float] | None:
    """Each ``(plan, batches per step)`` of ``runs`` run by the strategy's own step, as a trial runs it
    (each distinct plan built once), the runs taking turns step by step (a load that drifts slows them
    alike): each one's seconds per optimizer step, the slowest rank's median; ``None`` on every rank if
    it failed on any (every rank calls it).

    Example::

        replicas, pp = ParallelPlan("pipeline", 2, 1, 1), ParallelPlan("pipeline", 2, 2, 2)
        time_runs(trainer, model, [(replicas, 1), (replicas, 3), (pp, 1)], batch, meshes, (2, 5))
    """
    device = trainer.strategy.root_device
    result, error = None, None
    try:
        built: dict[str, Callable[[int, int], None]] = {}
        for plan, _ in runs:
            if plan.code() not in built:
                mesh = meshes.of(plan.layout(), host_tensors(plan, device))
                built[plan.code()] = _built(trainer, module, plan, batch, mesh)
        steps_of = [partial(built[plan.code()], batches=w) for plan, w in runs]
        result = _median_steps(steps_of, steps, device)
    except Exception as err:
        error = err
    finally:
        _release(device)
    try:
        agree(error)
    except Exception:
        return None
    assert result is not None
    return [slowest(s) for s in result]


def _barrier() -> None:
    if distributed_ready():
        dist.barrier()


def _quiet(message: str) -> None:
    """A trial's warnings: none (the same plan's would show in the run)."""


__all__ = [
    "Meshes",
    "Trial",
    "host_tensors",
    "measure_overhead",
    "optimizers_without_trainer",
    "run_trials",
    "time_plan",
    "time_runs",
    "time_windows",
]
