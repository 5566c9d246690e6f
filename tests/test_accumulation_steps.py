"""GradientAccumulationScheduler and step counts: estimated_stepping_batches, OneCycleLR, the progress bar.

Covers callbacks/_accumulation_internals.py's stepping estimate and progress-bar total.
"""

import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from mp_harness import assert_close_dicts, ddp_spawn, fit, quiet_trainer, reference_loader
from test_accumulation import Regressor, _data
from tiny_models import loader

from lightning_parallel import GradientAccumulationScheduler

MAX_LR = 0.1


def one_cycle_lrs(total_steps: int) -> list[float]:
    """The LR of each optimizer step of a OneCycleLR over ``total_steps``, in plain torch."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=MAX_LR)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, total_steps=total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


class OneCycleRegressor(Regressor):
    """Sizes a OneCycleLR from trainer.estimated_stepping_batches; records it and each step's LR."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=MAX_LR)
        total = self.trainer.estimated_stepping_batches
        self.recorded = {"estimate": total, "lrs": []}
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        self.recorded["lrs"].append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize(
    ("callback", "steps"),
    [
        (dict(global_batch_size=32), 4),  # 4 batches a step: 2 steps an epoch
        (dict(global_batch_size={0: 8, 2: 32}), 6),  # windows of 1, 1, 4, 2 batches, then 4, 4
        (dict(scheduling={0: 4, 1: 2}), 6),  # Lightning's form: 2 steps, then 4
    ],
)
def test_one_cycle_lr_sized_from_the_estimate_ends_with_the_run(tmp_path, callback, steps):
    # 64 samples, 8 a batch, 2 epochs: 16 batches; without the callback's count the estimate is 16.
    model = OneCycleRegressor()
    record = fit(
        model,
        loader(_data(64), 8),
        tmp_path,
        max_epochs=2,
        callbacks=[GradientAccumulationScheduler(**callback)],
    )[0]
    assert record["extra"]["estimate"] == steps
    assert record["extra"]["lrs"] == pytest.approx(one_cycle_lrs(steps), rel=1e-12)
    assert record["extra"]["lrs"][-1] == pytest.approx(MAX_LR / 25 / 1e4)  # OneCycleLR's final LR
    assert record["extra"]["lrs"][0] == pytest.approx(MAX_LR / 25)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_processes_estimate_the_same_steps_and_match_one_device(tmp_path):
    dataset = _data(64)
    callbacks = [GradientAccumulationScheduler(global_batch_size=32)]
    torch.manual_seed(0)
    # Per rank 32 samples, 4 batches of 8, 2 batches a step: 2 steps an epoch, 4 in all.
    records = fit(
        OneCycleRegressor(),
        loader(dataset, 8),
        tmp_path / "ddp",
        2,
        ddp_spawn(),
        max_epochs=2,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    one = fit(
        OneCycleRegressor(),
        reference_loader(dataset, 8),  # the same 32 samples a step, 4 batches of 8
        tmp_path / "one",
        max_epochs=2,
        callbacks=[GradientAccumulationScheduler(global_batch_size=32)],
    )[0]
    assert one["extra"]["estimate"] == 4
    for record in records:
        assert record["extra"]["estimate"] == 4
        assert record["extra"]["lrs"] == pytest.approx(one_cycle_lrs(4), rel=1e-12)
        assert_close_dicts(record["params"], one["params"], rtol=0, atol=1e-12)


class BarTotals(Callback):
    def on_train_start(self, trainer, pl_module):
        self.totals = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.totals[trainer.current_epoch] = trainer.progress_bar_callback.train_progress_bar.total


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar])
def test_the_progress_bar_counts_the_batches_of_a_max_steps_run(bar):
    # Lightning's default bar is Rich's where `rich` is installed, TQDM's elsewhere: both count right.
    probe = BarTotals()
    trainer = quiet_trainer(
        max_epochs=None,
        max_steps=3,
        enable_progress_bar=True,
        callbacks=[GradientAccumulationScheduler(global_batch_size=32), probe, bar()],
    )
    model = OneCycleRegressor()
    trainer.fit(model, loader(_data(64), 8))
    assert model.recorded["estimate"] == 3 and trainer.global_step == 3
    # 4 batches a step: the 8 batches of epoch 0 (2 steps), then 4 batches for the last step
    # (Lightning alone would show 3 and 1: one batch per remaining step).
    assert probe.totals == {0: 8, 1: 4}


def test_the_trainer_is_itself_again_after_fit():
    """The estimate replaces a property of the Trainer class (Lightning 2.6.6) for the fit only."""
    assert isinstance(inspect.getattr_static(L.Trainer, "estimated_stepping_batches"), property)
    trainer = quiet_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler(global_batch_size=32)])
    trainer.fit(OneCycleRegressor(), loader(_data(64), 8))
    assert type(trainer) is L.Trainer and trainer.global_step == 2
    assert trainer.estimated_stepping_batches == 8  # Lightning's own count again: one step per batch
