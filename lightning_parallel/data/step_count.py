"""Counting under an accumulation plan: optimizer steps of a run, batches of an epoch up to a step limit.

The windows are those :class:`~lightning_parallel.GradientAccumulationScheduler` makes: consecutive
batches of one epoch, ``factor`` at a time, the epoch's last window possibly short, a factor change
of a step-keyed ramp taking effect at the next window. Pure Python, like
:mod:`lightning_parallel.data.accumulation_plan`.
"""

from __future__ import annotations

import math

from lightning_parallel.data.accumulation_plan import AccumulationPlan

__all__ = ["batches_until_step", "count_optimizer_steps"]


def _window_stops(plan: AccumulationPlan, num_batches: int, first_step: int, epoch: int) -> list[int]:
    """The batch index after each window of an epoch that starts at optimizer step ``first_step``."""
    stops, start, step = [], 0, first_step
    while start < num_batches:
        start = min(start + plan.factor_at(step if plan.unit == "step" else epoch), num_batches)
        stops.append(start)
        step += 1
    return stops


def count_optimizer_steps(
    plan: AccumulationPlan, num_batches: int, max_epochs: int, max_steps: int = -1
) -> int:
    """Optimizer steps of ``max_epochs`` epochs of ``num_batches`` batches; at most ``max_steps`` unless -1.

    This is what ``trainer.estimated_stepping_batches`` should say under the plan.

    Example::

        plan = plan_from_global_batch({0: 8, 2: 32}, per_device=8, data_parallel_size=1)
        count_optimizer_steps(plan, num_batches=8, max_epochs=2)  # windows 1,1,4,2 then 4,4 batches: 6
    """
    steps = 0
    for epoch in range(max_epochs):
        if 0 <= max_steps <= steps:
            break
        last = plan.phases[-1]
        if plan.phase_at(steps if plan.unit == "step" else epoch) is last:
            # The factor no longer changes: every remaining epoch has the same windows.
            steps += math.ceil(num_batches / last.factor) * (max_epochs - epoch)
            break
        steps += len(_window_stops(plan, num_batches, steps, epoch))
    return steps if max_steps < 0 else min(steps, max_steps)


def batches_until_step(
    plan: AccumulationPlan, num_batches: int, epoch: int, first_step: int, max_steps: int
) -> int:
    """Batches of an epoch that starts at optimizer step ``first_step`` that run before step ``max_steps``.

    What a progress bar's total should be in a run bounded by ``max_steps`` rather than epochs.

    Example::

        plan = plan_from_global_batch(32, per_device=8, data_parallel_size=1)   # 4 batches a step
        batches_until_step(plan, num_batches=100, epoch=0, first_step=0, max_steps=3)  # 12
    """
    remaining = max_steps - first_step
    if remaining <= 0:
        return 0
    stops = _window_stops(plan, num_batches, first_step, epoch)
    return stops[remaining - 1] if remaining <= len(stops) else num_batches
