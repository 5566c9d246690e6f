"""GradientAccumulationScheduler in a Trainer: exact means, one all-reduce per step, 1 device == 2 devices.

Covers callbacks/_accumulation_internals.py (the loss multiplier and the window boundaries installed on the
Trainer, undone at teardown) through the callback.
"""

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import SingleDeviceStrategy
from mp_harness import assert_close_dicts, ddp_spawn, fit, quiet_trainer, reference_loader
from tiny_models import SequentialRegressor, loader, regression_data
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_parallel import GradientAccumulationScheduler
from lightning_parallel.callbacks import accumulation
from lightning_parallel.data.accumulation_plan import epoch_batch_sizes, epoch_windows, plan_from_global_batch

LR, DECAY = 0.1, 0.9


def _decay(step: int) -> float:
    return DECAY**step


class Regressor(SequentialRegressor):
    """The tiny MLP in float64, with a per-step LR schedule (so a scheduler stepping per batch shows)."""

    def __init__(self):
        super().__init__(lr=LR)
        self.double()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data(n: int) -> TensorDataset:
    x, y = regression_data(n).tensors
    return TensorDataset(x.double(), y.double())


def _counting_allreduce(probe, bucket):
    probe.allreduces += 1
    return allreduce_hook(None, bucket)


class MemoryLogger(Logger):
    """Keeps every log_metrics call (deliberately not rank-zero-only, so a log from rank 1 would show)."""

    def __init__(self):
        super().__init__()
        self.logged = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class StepProbe(Callback):
    """Per batch: the factor, the optimizer steps and the gradient all-reduces so far; grads at each step."""

    def __init__(self, snapshot_step: int | None = None):
        self.snapshot_step = snapshot_step

    def on_train_start(self, trainer, pl_module):
        self.rows, self.grads, self.allreduces, self.snapshot = [], [], 0, None
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(self, _counting_allreduce)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({k: p.grad.detach().clone() for k, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((batch_idx, trainer.accumulate_grad_batches, trainer.global_step, self.allreduces))
        if trainer.global_step == self.snapshot_step and self.snapshot is None:
            self.snapshot = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer, pl_module):
        logged = trainer.logger.logged if isinstance(trainer.logger, MemoryLogger) else []
        pl_module.recorded = {
            "rows": self.rows,
            "grads": self.grads,
            "snapshot": self.snapshot,
            "lr_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "logged": [(s, m) for s, m in logged if "global_batch_size" in m],
        }


def replay(model: L.LightningModule, dataset: TensorDataset, windows: list[list[int]]):
    """Plain torch: one SGD step per window on its samples' mean loss; (final params, grads per step)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
    grads = []
    for indices in windows:
        x, y = dataset[indices]
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        optimizer.step()
        scheduler.step()
    return dict(model.state_dict()), grads


def _index_windows(batch_windows, batch_indices):
    return [[i for b in range(w.start, w.stop) for i in batch_indices[b]] for w in batch_windows]


def _fit_one_device(tmp_path, dataset, batch_size, callback, max_epochs=1):
    torch.manual_seed(0)
    model = Regressor()
    initial = copy.deepcopy(model)
    callbacks = [callback, StepProbe()]
    record = fit(model, loader(dataset, batch_size), tmp_path, callbacks=callbacks, max_epochs=max_epochs)[0]
    return initial, record


@pytest.mark.parametrize(
    ("global_batch_size", "expected_windows"),
    [
        # 10 batches (the last of 5 samples), factor 4: the third window has 2 batches and 13 samples.
        (32, [(0, 4), (4, 8), (8, 10)]),
        # A ramp from 1 to 3 batches after 2 steps: the new windows start at batch 2, not a multiple of 3.
        ({0: 8, 2: 24}, [(0, 1), (1, 2), (2, 5), (5, 8), (8, 10)]),
    ],
)
def test_every_step_applies_the_exact_mean_gradient_of_its_window(
    tmp_path, global_batch_size, expected_windows
):
    dataset = _data(77)
    callback = GradientAccumulationScheduler(global_batch_size=global_batch_size)
    initial, record = _fit_one_device(tmp_path, dataset, 8, callback)
    plan = plan_from_global_batch(global_batch_size, per_device=8, data_parallel_size=1)
    windows = epoch_windows(epoch_batch_sizes(77, 8, 10, drop_last=False), plan.factor_at)
    assert [(w.start, w.stop) for w in windows] == expected_windows
    batch_indices = [list(range(b * 8, min(b * 8 + 8, 77))) for b in range(10)]
    expected_params, expected_grads = replay(initial, dataset, _index_windows(windows, batch_indices))
    grads = record["extra"]["grads"]
    assert len(grads) == len(windows)
    for got, want in zip(grads, expected_grads):
        assert_close_dicts(got, want, rtol=0, atol=1e-14)
    assert_close_dicts(record["params"], expected_params, rtol=0, atol=1e-12)
    # Steps happen exactly at window ends, and the LR scheduler stepped once per optimizer step.
    steps = [row[2] for row in record["extra"]["rows"]]
    assert steps == [sum(1 for w in windows if w.stop - 1 <= b) for b in range(10)]
    assert record["extra"]["lr_steps"] == len(windows)


def test_lightning_callback_form_steps_where_lightning_does_with_the_exact_mean(tmp_path):
    """scheduling={epoch: factor} means what it means in Lightning, whose last short window is not exact."""
    dataset, schedule = _data(77), {0: 4, 1: 2}
    initial, ours = _fit_one_device(tmp_path / "ours", dataset, 8, GradientAccumulationScheduler(schedule), 2)
    stock = L.pytorch.callbacks.GradientAccumulationScheduler(dict(schedule))
    theirs = _fit_one_device(tmp_path / "stock", dataset, 8, stock, 2)[1]
    assert [r[:3] for r in ours["extra"]["rows"]] == [r[:3] for r in theirs["extra"]["rows"]]
    batch_indices = [list(range(b * 8, min(b * 8 + 8, 77))) for b in range(10)]
    sizes = epoch_batch_sizes(77, 8, 10, drop_last=False)
    windows = [
        w
        for factor in (4, 2)
        for w in _index_windows(epoch_windows(sizes, lambda s, f=factor: f), batch_indices)
    ]
    expected_params, _ = replay(initial, dataset, windows)
    assert_close_dicts(ours["params"], expected_params, rtol=0, atol=1e-12)
    # Lightning's own callback divides the 2-batch window by 4: its parameters differ.
    with pytest.raises(AssertionError):
        assert_close_dicts(theirs["params"], expected_params, rtol=0, atol=1e-6)


def test_lightning_private_hooks_of_the_ramp_still_exist():
    """The step-keyed ramp overrides these two Lightning 2.6.6 private methods (see accumulation.py)."""
    assert callable(getattr(_TrainingEpochLoop, "_accumulated_batches_reached", None))
    assert callable(getattr(_AutomaticOptimization, "_make_zero_grad_fn", None))


def test_the_ramp_override_is_undone_at_teardown(tmp_path):
    trainer = quiet_trainer(
        max_epochs=None,
        max_steps=3,
        callbacks=[GradientAccumulationScheduler(global_batch_size={0: 8, 1: 16})],
    )
    model = Regressor()
    trainer.fit(model, loader(_data(64), 8))
    assert "_accumulated_batches_reached" not in vars(trainer.fit_loop.epoch_loop)
    assert "_make_zero_grad_fn" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)
    assert "training_step" not in vars(model)
    assert trainer.global_step == 3
    # The Trainer is left as setup requires it, so it can fit again with the callback.
    assert trainer.accumulate_grad_batches == 1
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(model, loader(_data(64), 8))
    assert trainer.global_step == 5


class ManualModel(Regressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.optimizers().step()


class Stream(IterableDataset):
    def __iter__(self):
        yield from _data(16)


def test_manual_optimization_is_refused_at_setup_with_lightnings_error():
    trainer = quiet_trainer(callbacks=[GradientAccumulationScheduler(global_batch_size=16)])
    match = r"`GradientAccumulationScheduler` is not supported for manual optimization, and ManualModel sets"
    with pytest.raises(RuntimeError, match=match):
        trainer.fit(ManualModel(), DataLoader(_data(32), batch_size=8))


@pytest.mark.parametrize(
    ("model", "data", "callback", "trainer_kwargs", "match"),
    [
        (
            Regressor,
            _data(32),
            dict(global_batch_size=16),
            dict(accumulate_grad_batches=2),
            r"`accumulate_grad_batches` and are using the `GradientAccumulationScheduler`.*"
            r"Trainer\(accumulate_grad_batches=2\)",
        ),
        (
            Regressor,
            _data(32),
            dict(global_batch_size=20),
            {},
            r"global_batch_size \(20\) is not a multiple.*\(8\) x .*\(1\) = 8.*16 or 24.*10 or 5",
        ),
        (
            Regressor,
            _data(32),
            dict(global_batch_size={0: 16, 5: 4}),
            {},
            r"at step 5: global_batch_size \(4\) is smaller than.*= 8",
        ),
        (Regressor, Stream(), dict(global_batch_size=16), {}, "no length"),
    ],
)
def test_bad_setups_fail_at_start_with_the_numbers(model, data, callback, trainer_kwargs, match):
    trainer = quiet_trainer(callbacks=[GradientAccumulationScheduler(**callback)], **trainer_kwargs)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model(), DataLoader(data, batch_size=8))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, TypeError, "exactly one"),
        (dict(scheduling={0: 2}, global_batch_size=64), TypeError, "exactly one"),
        (dict(scheduling=4), TypeError, "scheduling must be a dict"),
        (dict(scheduling={0: 0}), ValueError, "Accumulation factor should be an int greater than 0"),
        (dict(global_batch_size=-64), ValueError, "positive"),
        (dict(global_batch_size={0: 64, -1: 8}), ValueError, "negative"),
        (dict(global_batch_size={0: 64, 100: 128, 50: 256}), ValueError, "strictly increasing"),
        (dict(global_batch_size={10: 64}), ValueError, "step 0"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulationScheduler(**kwargs)


def test_the_data_parallel_size_is_the_samplers_replicas_not_the_world_size():
    class Strategy:
        distributed_sampler_kwargs = {"num_replicas": 2, "rank": 0}

    assert accumulation._data_parallel_size(Strategy()) == 2
    assert accumulation._data_parallel_size(object()) == 1


def test_a_batch_that_differs_from_the_loader_layout_is_warned_about_once(tmp_path):
    def drop_one_of_the_first(items):
        batch = torch.utils.data.default_collate(items)
        short = len(items) == 8 and float(batch[0][0, 0]) == float(dataset.tensors[0][0, 0])
        return [t[:-1] for t in batch] if short else batch

    dataset = _data(32)
    callback = GradientAccumulationScheduler(global_batch_size=16)
    trainer = quiet_trainer(callbacks=[callback], max_steps=2, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="batch 0 has 7 samples where the loader's layout says 8") as seen:
        trainer.fit(Regressor(), DataLoader(dataset, batch_size=8, collate_fn=drop_one_of_the_first))
    assert len([w for w in seen if "samples where the loader's layout" in str(w.message)]) == 1


# One 2-process run records everything: 1000 samples, 8 per device; 64 a step for 10 steps, then 192.
# Per rank 63 batches (the last of 4): windows of 4 batches x 10, of 12 from batch 40 (not a multiple of
# 12), and a last one of 11 batches (84 samples a rank). The harness's reference loader (one process,
# batch 64) sees the same samples per step, so the steps can be replayed in plain torch.
RAMP, N_SAMPLES, STEPS_AT_64 = {0: 64, 10: 192}, 1000, 10


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_two_processes_match_one_device_and_all_reduce_once_per_step(tmp_path):
    dataset = _data(N_SAMPLES)
    torch.manual_seed(0)
    model = Regressor()
    initial = copy.deepcopy(model)
    callbacks = [GradientAccumulationScheduler(global_batch_size=RAMP), StepProbe(snapshot_step=STEPS_AT_64)]
    records = fit(
        model,
        loader(dataset, 8),
        tmp_path / "ddp",
        2,
        ddp_spawn(),
        callbacks=callbacks,
        logger=MemoryLogger(),
    )

    # 1 device x batch 64, Lightning without the callback: the same parameters after 10 steps.
    torch.manual_seed(0)
    one = fit(Regressor(), reference_loader(dataset, 64), tmp_path / "one", max_steps=STEPS_AT_64)[0]
    for record in records:
        assert_close_dicts(record["extra"]["snapshot"], one["params"], rtol=0, atol=1e-12)

    # The whole ramp, last incomplete window included, against plain torch on the same samples.
    perm = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))
    per_rank = epoch_batch_sizes(N_SAMPLES // 2, 8, 63, drop_last=False)
    windows = epoch_windows(per_rank, plan_from_global_batch(RAMP, 8, 2).factor_at)
    assert [len(w) for w in windows] == [4] * 10 + [12, 11]
    index_windows = [perm[w.start * 16 : w.start * 16 + 2 * w.samples] for w in windows]
    expected_params, expected_grads = replay(initial, dataset, index_windows)
    for record in records:
        assert_close_dicts(record["params"], expected_params, rtol=0, atol=1e-12)
        for got, want in zip(record["extra"]["grads"], expected_grads, strict=True):
            assert_close_dicts(got, want, rtol=0, atol=1e-13)

    for record in records:
        rows = record["extra"]["rows"]
        assert len(rows) == 63
        # One gradient all-reduce per optimizer step, none on accumulation batches.
        assert [r[3] for r in rows] == [r[2] for r in rows]
        assert [r[2] for r in rows] == [sum(1 for w in windows if w.stop - 1 <= b) for b in range(63)]
        # The factor changes only at a window start; the LR scheduler stepped once per optimizer step.
        assert [r[1] for r in rows] == [w.factor for w in windows for _ in range(len(w))]
        assert record["extra"]["lr_steps"] == len(windows) == rows[-1][2]
    # Logged on change, on rank 0 only.
    assert [
        (s, m["global_batch_size"], m["accumulate_grad_batches"]) for s, m in records[0]["extra"]["logged"]
    ] == [
        (0, 64.0, 4.0),
        (10, 192.0, 12.0),
    ]
    assert records[1]["extra"]["logged"] == []


class SelfAccumulating(SingleDeviceStrategy):
    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


def test_a_strategy_that_accumulates_by_itself_is_refused():
    strategy = SelfAccumulating(device=torch.device("cpu"))
    trainer = quiet_trainer(
        strategy=strategy, callbacks=[GradientAccumulationScheduler(global_batch_size=16)]
    )
    with pytest.raises(
        RuntimeError, match=r"`SelfAccumulating` does not support .* accumulates gradients by itself"
    ):
        trainer.fit(Regressor(), DataLoader(_data(32), batch_size=8))


def test_several_train_loaders_are_refused():
    trainer = quiet_trainer(callbacks=[GradientAccumulationScheduler(global_batch_size=16)])
    loaders = {"a": DataLoader(_data(32), batch_size=8), "b": DataLoader(_data(32), batch_size=8)}
    with pytest.raises(TypeError, match="needs one torch DataLoader for training, got dict"):
        trainer.fit(Regressor(), loaders)
