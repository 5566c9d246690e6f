"""What the pipeline may do with the gradients already there when its schedule runs: Lightning's answer.

Asked of a real Trainer at every batch, with Lightning's accumulation, with GradientAccumulationScheduler's
step-keyed ramp (windows that do not start at multiples of the factor), and with a hook that reads them.
"""

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from mp_harness import quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import GradientAccumulationScheduler
from lightning_parallel.strategies.pipeline.earlier_gradients import earlier_gradients


class Ask(Callback):
    def __init__(self):
        self.answers = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.answers.append(earlier_gradients(trainer, pl_module, batch_idx))


class ReadsGradients(Callback):
    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        pass


def _answers(*callbacks, **trainer_kwargs):
    ask = Ask()
    trainer = quiet_trainer(devices=1, callbacks=[*callbacks, ask], **trainer_kwargs)
    trainer.fit(SequentialRegressor(), loader(regression_data(48), 8))  # 6 batches
    return ask.answers


def test_the_first_batch_of_a_window_drops_them_and_the_others_add_into_them():
    assert _answers() == ["drop"] * 6
    assert _answers(accumulate_grad_batches=2) == ["drop", "add"] * 3
    assert _answers(accumulate_grad_batches=4) == ["drop", "add", "add", "add", "drop", "add"]


def test_the_windows_of_a_step_keyed_ramp_are_the_ones_in_force():
    # global batch 8 for the first step, then 24: windows of 1 batch, then 3 (batches 1-3), then 2 left.
    ramp = GradientAccumulationScheduler(global_batch_size={0: 8, 1: 24})
    assert _answers(ramp) == ["drop", "drop", "add", "add", "drop", "add"]


def test_a_hook_that_may_read_them_keeps_them():
    assert _answers(ReadsGradients(), accumulate_grad_batches=2) == ["keep"] * 6


@pytest.mark.parametrize("name", ["_make_zero_grad_fn", "_skip_backward"])
def test_lightning_still_decides_zeroing_where_this_asks(name):
    # Private to Lightning 2.6.6: if it moves, the pipeline keeps the gradients (2x memory), silently
    # correct but no longer lean; this test is what says so.
    automatic = _AutomaticOptimization(trainer=None)
    assert hasattr(automatic, name)


def test_lightning_still_says_whether_a_batch_steps_the_optimizer():
    """Canary for ends_optimizer_step: Lightning 2.6.6's private ``_FitLoop._should_accumulate``
    (without it the overlapped reduction silently runs after the schedule, exact but not overlapped)."""
    from lightning.pytorch.loops.fit_loop import _FitLoop

    assert callable(getattr(_FitLoop, "_should_accumulate", None))


def test_a_backward_hook_keeps_the_reduction_after_it_but_the_watchdogs_does_not():
    from lightning.pytorch import Trainer

    from lightning_parallel import HangWatchdog
    from lightning_parallel.strategies.pipeline.earlier_gradients import hooks_write_gradients

    class ScalesGradients(Callback):
        def on_after_backward(self, trainer, pl_module):
            pass

    module = SequentialRegressor()
    assert not hooks_write_gradients(Trainer(callbacks=[HangWatchdog()], logger=False), module)
    assert hooks_write_gradients(Trainer(callbacks=[HangWatchdog(), ScalesGradients()], logger=False), module)
