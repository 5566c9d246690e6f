"""Measure how long each pipeline unit's forward and backward take, and the optimizer step per element.

The time model's counterpart of :mod:`~lightning_parallel.planner.probe`: the same units, the same step
(``training_step``), timed on this machine at two micro-batch sizes (under ``plan="auto"`` on every rank
at once, as the steps will share the machine) so that each unit gets a straight line
``seconds = a + b x samples`` (the intercept is what a micro-batch costs whatever its size:
Python, kernel launches; the slope what each sample adds). Module hooks time each unit's forward
(outermost calls only) and backward; what runs between units (a residual add, the loss) is charged
to the unit before it, or before the first one (:data:`~lightning_parallel.planner.probe.BEFORE`), as
the memory probe charges its bytes. A unit whose backward a hook cannot see (an embedding fed
integers: its backward hook fires before its backward runs) takes a share of what the whole backward
measured beyond the timed units, in proportion to its forward.

The optimizer step is timed apart (:mod:`~lightning_parallel.planner.optimizer_time`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_parallel.planner.optimizer_time import StepCost, optimizer_step_cost
from lightning_parallel.planner.probe import BEFORE, StepFn, _autocast, default_step
from lightning_parallel.planner.units import UnitLayout
from lightning_parallel.techniques.contract import UnitSample

AFTER = "<after>"  # suffix: time spent outside any unit after this one returned (a residual add, the loss)


@dataclass(frozen=True)
class TimeLine:
    """Seconds as a function of samples: ``intercept + slope x samples`` (never below zero).

    Example::

        >>> TimeLine(0.001, 0.0005).at(4)
        0.003
    """

    intercept: float = 0.0
    slope: float = 0.0

    def at(self, samples: float) -> float:
        return max(0.0, self.intercept + self.slope * samples)

    def __add__(self, other: TimeLine) -> TimeLine:
        return TimeLine(self.intercept + other.intercept, self.slope + other.slope)


@dataclass(frozen=True)
class UnitTime:
    """One unit's forward and backward seconds per micro-batch, as lines in its samples."""

    forward: TimeLine = field(default_factory=TimeLine)
    backward: TimeLine = field(default_factory=TimeLine)


@dataclass
class TimeFacts:
    """What :func:`measure_times` found: per unit (its own time and what follows it), the optimizer step.

    Example::

        times = measure_times(model, layout, batch, sizes=(4, 16))
        times.unit("h.0").forward.at(8)        # seconds of block 0's forward on 8 samples
    """

    units: dict[str, UnitTime]
    sizes: tuple[int, ...]
    step: StepCost  # the optimizer step on the device
    host_step: StepCost  # the same step on the host (offload)
    device: str = "cpu"
    samples: list[UnitSample] = field(default_factory=list)  # a block and the smallest unit, with inputs
    measured: dict[str, Any] = field(default_factory=dict)  # by technique name: its in-place measurement

    def unit(self, name: str) -> UnitTime:
        """``name``'s time with what runs after it outside any unit (the residual add, the loss)."""
        own, after = self.units.get(name, UnitTime()), self.units.get(name + AFTER, UnitTime())
        return UnitTime(own.forward + after.forward, own.backward + after.backward)


def measure_times(
    module: nn.Module,
    layout: UnitLayout,
    batch: Any,
    sizes: tuple[int, ...],
    optimizers: list[torch.optim.Optimizer] | None = None,
    step: StepFn = default_step,
    repeats: int = 3,
    autocast_dtype: torch.dtype | None = None,
    sync: Callable[[], None] | None = None,
) -> TimeFacts:
    """Time ``step`` and its backward on the first ``n`` samples of ``batch`` for each ``n`` in ``sizes``.

    Runs where the module is (the model is left as it was: gradients, buffers, RNG); each size is
    warmed up once, then the median of ``repeats`` runs is kept per unit (``plan="auto"`` times on every
    rank at once, ``sync`` lining them up before each run, so the runs share the machine as the steps
    will: the typical run is what a step sees), and units of the same structure (a model's blocks) share
    their mean. The warm-up records the inputs of a block and of the smallest unit with parameters
    (``TimeFacts.samples``: what the techniques time in place, :class:`TimeBench`).

    Raises:
        ValueError: the module rejects the batch, or the batch has fewer samples than ``max(sizes)``.

    Example::

        times = measure_times(model, find_units(model), (x, y), sizes=(2, 8), optimizers=[adamw])
    """
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    have = _samples(batch)
    if have < max(sizes):
        raise ValueError(
            f"the batch has {have} samples, the time probe needs {max(sizes)}: pass a larger one"
        )
    runs: list[dict[str, tuple[float, float]]] = []
    samples = _sampled_units(layout)
    for n in sizes:
        inputs = _slice(batch, n, device)
        with _autocast(device, autocast_dtype):
            with _recording(samples, n):
                _timed_run(module, layout, inputs, step, device)  # (the warm-up)
            timings = []
            for _ in range(repeats):
                if sync is not None:
                    sync()
                timings.append(_timed_run(module, layout, inputs, step, device))
        runs.append({k: _typical([t[k] for t in timings if k in t]) for k in timings[0]})
    runs = [_alike_averaged(r, layout) for r in runs]
    units = {
        name: UnitTime(_line(sizes, [r.get(name, (0, 0))[0] for r in runs]),
                       _line(sizes, [r.get(name, (0, 0))[1] for r in runs]))
        for name in dict.fromkeys(k for r in runs for k in r)
    }  # fmt: skip
    cost = optimizer_step_cost(optimizers or [], device)
    host = optimizer_step_cost(optimizers or [], torch.device("cpu"), on_host=True)
    return TimeFacts(units, tuple(sizes), cost, host, device.type, [s for s in samples if s.inputs])


def _sampled_units(layout: UnitLayout) -> list[UnitSample]:
    """The units the techniques time in place: a block (of the structure most units share), then the
    smallest unit with parameters (when it is another)."""
    groups: dict[tuple, list[Any]] = {}
    for u in layout.units:
        shapes = tuple(tuple(p.shape) for p in u.module.parameters())
        if shapes:
            groups.setdefault((type(u.module), shapes), []).append(u)
    if not groups:
        return []
    block = max(groups.values(), key=len)[0]
    with_params = [u for g in groups.values() for u in g]
    small = min(with_params, key=lambda u: sum(p.numel() * p.element_size() for p in u.module.parameters()))
    chosen = [block] + ([small] if small is not block else [])
    return [UnitSample(u.name, u.module, {}) for u in chosen]


@contextlib.contextmanager
def _recording(samples: list[UnitSample], size: int) -> Iterator[None]:
    """Keep each sampled unit's first call's inputs at ``size`` samples (detached copies)."""

    def keep(sample: UnitSample) -> Callable[..., None]:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            if size not in sample.inputs:
                sample.inputs[size] = (_detached(args), _detached(kwargs))

        return hook

    handles = [s.module.register_forward_pre_hook(keep(s), with_kwargs=True) for s in samples]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _detached(tree: Any) -> Any:
    def one(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        return t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())

    return tree_map(one, tree)


class _Clock:
    """Per unit: forward seconds (outermost calls) and backward seconds; gaps charged to the unit before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.forward: dict[str, float] = {}
        self.backward: dict[str, float] = {}
        self.untimed: set[str] = set()  # units whose backward the hooks cannot see
        self.stack: list[str] = []
        self.mark = 0.0
        self.last = BEFORE
        self.started: dict[str, float] = {}

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def charge_gap(self) -> None:
        """Charge the time since the last mark to what ran outside any unit."""
        now = self.now()
        where = self.last if self.last == BEFORE else self.last + AFTER
        self.forward[where] = self.forward.get(where, 0.0) + now - self.mark
        self.mark = now

    def enter(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.stack:
                self.charge_gap()
                if not any(t.requires_grad for t in _tensors((args, kwargs)) if t.is_floating_point()):
                    self.untimed.add(name)
            self.stack.append(name)

        return hook

    def leave(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.stack.pop()
            if not self.stack:
                now = self.now()
                self.forward[name] = self.forward.get(name, 0.0) + now - self.mark
                self.mark, self.last = now, name

        return hook

    def backward_start(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.started[name] = self.now()

        return hook

    def backward_end(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            start = self.started.pop(name, None)
            if start is not None:
                self.backward[name] = self.backward.get(name, 0.0) + self.now() - start

        return hook

    @contextlib.contextmanager
    def hooks(self, layout: UnitLayout) -> Iterator[None]:
        handles = []
        for unit in layout.units:
            m, name = unit.module, unit.name
            handles += [
                m.register_forward_pre_hook(self.enter(name), with_kwargs=True),
                m.register_forward_hook(self.leave(name), always_call=True),
                m.register_full_backward_pre_hook(self.backward_start(name)),
                m.register_full_backward_hook(self.backward_end(name)),
            ]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "full backward hook ... no inputs require gradients"
                yield
        finally:
            for h in handles:
                h.remove()


def _timed_run(
    module: nn.Module, layout: UnitLayout, batch: Any, step: StepFn, device: torch.device
) -> dict[str, tuple[float, float]]:
    """One forward and backward: ``{unit: (forward s, backward s)}`` (gaps under ``unit + AFTER``)."""
    clock = _Clock(device)
    with _preserved(module), clock.hooks(layout):
        clock.mark = clock.now()
        loss = _loss(_run(step, module, batch))
        clock.charge_gap()
        forward_end = clock.now()
        loss.backward()
        total_backward = clock.now() - forward_end
    timed = {n: b for n, b in clock.backward.items() if n not in clock.untimed}
    # What the hooks did not see (untimed units, the code between units, the loss) shares the rest
    # of the measured backward in proportion to its forward.
    rest = max(0.0, total_backward - sum(timed.values()))
    others = {n: f for n, f in clock.forward.items() if n not in timed}
    weight = sum(others.values()) or 1.0
    backward = timed | {n: rest * f / weight for n, f in others.items()}
    return {
        n: (clock.forward.get(n, 0.0), backward.get(n, 0.0)) for n in clock.forward.keys() | backward.keys()
    }


def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = out.get("loss", out)
    if torch.is_tensor(out) and out.dim() == 0 and out.requires_grad:
        return out
    floats = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError("the step returned no tensor with a gradient: the time probe has nothing to time")
    return sum(t.float().sum() for t in floats)  # type: ignore[return-value]


def _run(step: StepFn, module: nn.Module, batch: Any) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return step(module, batch)
    except Exception as err:
        raise ValueError(
            f"{type(module).__name__} rejected the time probe's batch: {type(err).__name__}: {err}"
        ) from err


@contextlib.contextmanager
def _preserved(module: nn.Module) -> Iterator[None]:
    """The probe leaves the model as it was: gradients, buffers, RNG and train mode."""
    grads = {p: p.grad for p in module.parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    was_training = module.training
    module.train()
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            yield
    finally:
        module.train(was_training)
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


def _typical(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def _alike_averaged(
    run: dict[str, tuple[float, float]], layout: UnitLayout
) -> dict[str, tuple[float, float]]:
    """Units of one class with the same parameter shapes (the blocks) take their mean time."""
    groups: dict[tuple, list[str]] = {}
    for u in layout.units:
        shapes = tuple(tuple(p.shape) for p in u.module.parameters())
        groups.setdefault((type(u.module), shapes), []).append(u.name)
    out = dict(run)
    for names in groups.values():
        present = [n for n in names if n in run]
        if len(present) > 1:
            mean = tuple(statistics.fmean(run[n][i] for n in present) for i in (0, 1))
            out.update({n: (mean[0], mean[1]) for n in present})
    return out


def _line(sizes: tuple[int, ...], values: list[float]) -> TimeLine:
    if len(sizes) == 1 or sizes[0] == sizes[-1]:
        return TimeLine(0.0, values[0] / sizes[0])
    slope = (values[-1] - values[0]) / (sizes[-1] - sizes[0])
    return TimeLine(values[0] - slope * sizes[0], slope)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if torch.is_tensor(t)]


def _samples(batch: Any) -> int:
    return next((int(t.shape[0]) for t in _tensors(batch) if t.dim() > 0), 0)


def _slice(batch: Any, n: int, device: torch.device) -> Any:
    return tree_map(lambda x: x[:n].to(device) if torch.is_tensor(x) and x.dim() > 0 else x, batch)
