"""Optimizer steps and batches under an accumulation plan, against the windows the callback makes."""

import pytest

from lightning_parallel.data.accumulation_plan import epoch_windows, plan_from_factors, plan_from_global_batch
from lightning_parallel.data.step_count import batches_until_step, count_optimizer_steps


def _windows_of_a_run(plan, num_batches: int, max_epochs: int) -> list[list]:
    """Epoch by epoch, the windows GradientAccumulationScheduler makes (no step limit)."""
    run, step = [], 0
    for epoch in range(max_epochs):
        factor = plan.factor_at if plan.unit == "step" else (lambda s, e=epoch: plan.factor_at(e))
        windows = epoch_windows((1,) * num_batches, factor, first_step=step)
        run.append(windows)
        step += len(windows)
    return run


PLANS = [
    plan_from_global_batch(32, per_device=8, data_parallel_size=1),
    plan_from_global_batch({0: 8, 2: 32}, per_device=8, data_parallel_size=1),
    # a change lands mid-epoch
    plan_from_global_batch({0: 16, 3: 48, 11: 96}, per_device=8, data_parallel_size=2),
    plan_from_factors({0: 4, 1: 2, 3: 3}, per_device=8, data_parallel_size=1),
]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("num_batches", [1, 7, 8, 13])
def test_the_step_count_is_the_number_of_windows(plan, num_batches):
    for max_epochs in (1, 2, 5):
        windows = _windows_of_a_run(plan, num_batches, max_epochs)
        total = sum(len(w) for w in windows)
        assert count_optimizer_steps(plan, num_batches, max_epochs) == total
        for max_steps in (0, 1, total - 1, total, total + 3):
            expected = min(total, max(max_steps, 0))
            assert count_optimizer_steps(plan, num_batches, max_epochs, max_steps) == expected


def test_a_long_run_is_counted_without_walking_every_epoch():
    plan = plan_from_global_batch({0: 8, 2: 32}, per_device=8, data_parallel_size=1)
    assert count_optimizer_steps(plan, 8, max_epochs=2) == 6  # windows of 1, 1, 4, 2 then 4, 4 batches
    first_epoch = 2 + (10**6 - 2 + 3) // 4  # two windows of 1 batch, then of 4 (the last one short)
    assert count_optimizer_steps(plan, 10**6, max_epochs=10**6) == first_epoch + (10**6 - 1) * 10**6 // 4


@pytest.mark.parametrize("plan", PLANS)
def test_batches_until_a_step_limit(plan):
    num_batches = 13
    for epoch, windows in enumerate(_windows_of_a_run(plan, num_batches, 3)):
        first_step = sum(len(w) for w in _windows_of_a_run(plan, num_batches, epoch))
        for remaining in range(len(windows) + 2):
            got = batches_until_step(plan, num_batches, epoch, first_step, first_step + remaining)
            expected = windows[remaining - 1].stop if 0 < remaining <= len(windows) else num_batches
            assert got == (0 if remaining == 0 else expected)
