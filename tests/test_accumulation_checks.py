"""GradientAccumulationScheduler refuses what Lightning's does, with the same exception types and messages.

Covers callbacks/_accumulation_checks.py, where those checks live.
"""

import warnings
from unittest.mock import Mock

import lightning as L
import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tiny_models import SequentialRegressor

from lightning_parallel import GradientAccumulationScheduler


def _bare_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("scheduling", [{1: 2, -3: 4}, {0: 2, "2": 1}, {0.5: 2}])
def test_bad_epochs_are_lightnings_misconfiguration(scheduling):
    with pytest.raises(
        MisconfigurationException, match=r"Epoch should be an int greater than or equal to 0\. Got"
    ):
        GradientAccumulationScheduler(scheduling=scheduling)


@pytest.mark.parametrize("scheduling", [{1: 0, 3: 4}, {0: 2, 2: "2"}, {0: True}])
def test_bad_factors_are_lightnings_misconfiguration(scheduling):
    with pytest.raises(
        MisconfigurationException, match=r"Accumulation factor should be an int greater than 0\. Got"
    ):
        GradientAccumulationScheduler(scheduling)


def test_a_bad_schedule_is_also_a_value_error_and_an_empty_one_a_type_error():
    with pytest.raises(ValueError, match="Epoch should be an int"):
        GradientAccumulationScheduler({-1: 2})
    with pytest.raises(TypeError, match="Empty dict cannot be interpreted correct"):
        GradientAccumulationScheduler({})


def test_epochs_in_any_order_are_read_in_order_as_lightning_does():
    assert GradientAccumulationScheduler({3: 4, 1: 2}).scheduling == {1: 2, 3: 4}


def test_a_deepspeed_strategy_is_refused_at_train_start_with_lightnings_error():
    trainer = Mock(spec=L.Trainer, strategy=Mock(spec=DeepSpeedStrategy), accumulate_grad_batches=1)
    with pytest.raises(
        RuntimeError, match=r"does not support `accumulate_grad_batches` changing between epochs"
    ):
        GradientAccumulationScheduler({1: 2}).on_train_start(trainer, SequentialRegressor())


def test_manual_optimization_is_refused_at_train_start_with_lightnings_error():
    model = SequentialRegressor()
    model.automatic_optimization = False
    match = r"Automatic gradient accumulation and the `GradientAccumulationScheduler` is not supported"
    with pytest.raises(RuntimeError, match=match):
        GradientAccumulationScheduler({1: 2}).on_train_start(_bare_trainer(), model)


class StepOverridden(SequentialRegressor):
    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)


class ZeroGradOverridden(SequentialRegressor):
    def optimizer_zero_grad(self, *args, **kwargs):
        super().optimizer_zero_grad(*args, **kwargs)


@pytest.mark.parametrize("model", [StepOverridden, ZeroGradOverridden])
def test_overridden_optimizer_hooks_get_lightnings_warning_when_accumulating(model):
    with pytest.warns(UserWarning, match="the hooks will not be called on every batch"):
        GradientAccumulationScheduler({1: 2}).on_train_start(_bare_trainer(), model())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradientAccumulationScheduler({0: 1}).on_train_start(_bare_trainer(), model())  # never accumulates


def test_trainer_accumulate_grad_batches_with_the_callback_is_lightnings_value_error():
    trainer = _bare_trainer(accumulate_grad_batches=2)
    match = (
        r"You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` callback"
    )
    with pytest.raises(ValueError, match=match):
        GradientAccumulationScheduler({0: 2}).on_train_start(trainer, SequentialRegressor())
