"""The plan to size: from ``"auto"``, ``"ddp"``, ``"pipeline"``, a :class:`ParallelPlan` or a strategy."""

from __future__ import annotations

from typing import Any

from lightning_parallel.layout.choices import SCHEDULES
from lightning_parallel.plan.parallel_plan import ParallelPlan


def resolve(strategy: Any, devices: int, precision: str) -> ParallelPlan:
    """The :class:`ParallelPlan` that ``strategy`` runs on ``devices`` ranks in ``precision``.

    ``"auto"`` (or None) is what ``Trainer(devices=...)`` runs: one device without DDP, several with
    DDP. A ``PipelineStrategy`` carries its plan (``strategy.parallel_plan``): this package's planner
    reads that, and does not import Lightning.

    Example::

        >>> resolve("auto", devices=1, precision="32-true").label()  # Trainer(devices=1): no DDP
        'single device'
        >>> resolve("auto", devices=4, precision="32-true").label()
        'ddp x4'
        >>> resolve(ParallelPlan(pipeline_size=2), devices=4, precision="32-true").label()
        'pp 2x2 1f1b m=4'
    """
    plan = strategy if isinstance(strategy, ParallelPlan) else getattr(strategy, "parallel_plan", None)
    if isinstance(plan, ParallelPlan):
        return plan.for_devices(devices, precision)
    if strategy in ("auto", None):
        strategy = "single_device" if devices == 1 else "ddp"
    if strategy in ("ddp", "single_device"):
        return ParallelPlan(strategy, devices=devices, precision=precision)
    if strategy == "pipeline":
        return ParallelPlan("pipeline", devices, devices, 4, precision=precision)
    raise ValueError(
        "strategy must be 'auto', 'single_device', 'ddp', 'pipeline', a ParallelPlan or a "
        f"PipelineStrategy, got {strategy!r}; the schedules are {', '.join(SCHEDULES)}"
    )
