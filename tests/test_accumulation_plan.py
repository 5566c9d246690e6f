"""Global-batch arithmetic, plans, windows and loss weights: pure logic, no Trainer, no processes."""

import pytest
import torch
from torch import nn

from lightning_parallel.data.accumulation_plan import (
    AccumulationPlan,
    Window,
    check_equal_across_replicas,
    epoch_batch_sizes,
    epoch_windows,
    factor_for_global_batch,
    loss_multiplier,
    nearest_valid_choices,
    next_window,
    plan_from_factors,
    plan_from_global_batch,
    validate_schedule,
)


def test_factor_keeps_the_global_batch_at_any_device_count():
    # The example: 4 devices x 32 per device keep 128; 1 device needs 4 accumulated batches.
    assert factor_for_global_batch(128, 32, 4) == 1
    assert factor_for_global_batch(128, 32, 1) == 4
    assert factor_for_global_batch(256, 8, 2) == 16


def test_a_global_batch_the_loader_cannot_give_names_the_numbers_and_the_nearest_choices():
    with pytest.raises(
        ValueError, match=r"global_batch_size \(100\) is not a multiple.*= 16.*96 or 112.*10 or 5"
    ):
        factor_for_global_batch(100, 8, 2)
    with pytest.raises(
        ValueError, match=r"global_batch_size \(8\) is smaller than.*\(8\) x .*\(2\) = 16.*16.*4"
    ):
        factor_for_global_batch(8, 8, 2)


def test_nearest_valid_choices():
    choices = nearest_valid_choices(100, 8, 2)
    assert choices.global_batch_sizes == (96, 112)
    assert choices.per_device_batch_sizes == (10, 5)
    # An odd global batch cannot be split over 2 replicas at any per-device size.
    assert nearest_valid_choices(33, 4, 2).per_device_batch_sizes == ()
    assert nearest_valid_choices(4, 8, 1).global_batch_sizes == (8,)


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        ({}, ValueError, "empty"),
        ({0: 0}, ValueError, "positive"),
        ({0: -4}, ValueError, "positive"),
        ({-1: 4}, ValueError, "negative"),
        ({4: 2, 0: 8}, ValueError, r"strictly increasing.*\[0, 4\]"),
        ({0: 2.0}, TypeError, "ints"),
        ({0: True}, TypeError, "ints"),
        ("64", TypeError, "int or a dict"),
        (0, ValueError, "positive"),
    ],
)
def test_bad_schedules(schedule, error, match):
    with pytest.raises(error, match=match):
        validate_schedule(schedule, "global_batch_size", "optimizer step")


def test_a_ramp_must_say_the_size_at_step_zero():
    with pytest.raises(ValueError, match=r"step 0.*\{0: 64"):
        plan_from_global_batch({100: 64}, 8, 1)


def test_a_ramp_entry_the_loader_cannot_give_names_its_step():
    with pytest.raises(ValueError, match=r"at step 1000: global_batch_size \(250\)"):
        plan_from_global_batch({0: 64, 1000: 250}, 8, 2)


def test_plan_from_global_batch_ramp_and_table():
    plan = plan_from_global_batch({0: 64, 1000: 256}, per_device=8, data_parallel_size=2)
    assert isinstance(plan, AccumulationPlan)
    assert [plan.factor_at(s) for s in (0, 999, 1000, 5000)] == [4, 4, 16, 16]
    assert plan.changes_mid_epoch
    table = str(plan).splitlines()
    assert table[0].split() == [
        "from",
        "step",
        "global",
        "batch",
        "per-device",
        "batch",
        "replicas",
        "accumulate",
    ]
    assert table[2].split() == ["0", "64", "8", "2", "4"]
    assert table[3].split() == ["1000", "256", "8", "2", "16"]
    assert not plan_from_global_batch(64, 8, 2).changes_mid_epoch


def test_plan_from_factors_is_lightnings_epoch_form():
    plan = plan_from_factors({0: 8, 4: 4}, per_device=32, data_parallel_size=1)
    assert [plan.factor_at(e) for e in (0, 3, 4, 10)] == [8, 8, 4, 4]
    assert plan.phase_at(0).global_batch_size == 256
    # As in Lightning, epochs before the first key accumulate 1 batch.
    assert plan_from_factors({2: 4}, 8, 1).factor_at(1) == 1
    assert not plan_from_factors({0: 8, 4: 4}, 32, 1).changes_mid_epoch


def test_epoch_batch_sizes():
    assert epoch_batch_sizes(37, 8, 5, drop_last=False) == (8, 8, 8, 8, 5)
    assert epoch_batch_sizes(37, 8, 4, drop_last=True) == (8, 8, 8, 8)
    assert epoch_batch_sizes(37, 8, 3, drop_last=False) == (8, 8, 8)  # limit_train_batches


def test_windows_end_with_a_short_last_window():
    sizes = (8,) * 9 + (5,)
    windows = epoch_windows(sizes, lambda step: 4)
    assert [(w.start, w.stop, w.samples) for w in windows] == [(0, 4, 32), (4, 8, 32), (8, 10, 13)]
    assert next_window(8, 4, sizes) == Window(8, 10, 4, 13)
    with pytest.raises(ValueError, match="past the epoch"):
        next_window(10, 4, sizes)


def test_a_ramp_changes_the_factor_only_at_a_window_boundary():
    # Factor 1 for steps 0-1, then 3: the change lands at batch 2, not at a multiple of 3.
    windows = epoch_windows((4,) * 10, lambda step: 1 if step < 2 else 3)
    assert [(w.start, w.stop) for w in windows] == [(0, 1), (1, 2), (2, 5), (5, 8), (8, 10)]
    # Each window keeps the factor it started with, even if the step counter passes a key inside it.
    windows = epoch_windows((4,) * 8, lambda step: 4 if step < 1 else 2)
    assert [(w.start, w.stop, w.factor) for w in windows] == [(0, 4, 4), (4, 6, 2), (6, 8, 2)]


def test_loss_multipliers_give_the_exact_sample_mean_of_a_short_window():
    """sum multiplier_i · mean_loss_i / factor over a window equals the mean loss of all its samples."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    x, y = torch.randn(13, 3, dtype=torch.float64), torch.randn(13, 1, dtype=torch.float64)
    window = Window(8, 10, 4, 13)
    total = 0.0
    for lo, hi in ((0, 8), (8, 13)):
        mean = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        total = total + mean * loss_multiplier(window, hi - lo, 4) / 4
    exact = nn.functional.mse_loss(model(x), y)
    torch.testing.assert_close(total, exact, rtol=0, atol=1e-15)
    assert loss_multiplier(Window(0, 4, 4, 32), 8, 4) == 1.0


def test_replicas_must_share_the_layout():
    check_equal_across_replicas([[8, 32], [8, 32]], ["batch_size", "samples"])
    with pytest.raises(ValueError, match=r"rank 1: batch_size=4, samples=32.*same batch size"):
        check_equal_across_replicas([[8, 32], [4, 32]], ["batch_size", "samples"])
