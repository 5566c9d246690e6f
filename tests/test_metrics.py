"""AllReducedMetrics: rank 0's CSV log holds the exact all-rank values (CPU, gloo, spawn).

Covers callbacks/metrics.py.
"""

import csv
import glob
import itertools
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from mp_harness import RankRecorder, ddp_spawn, load_rank_results, quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import AllReducedMetrics

W = 2  # processes
STEPS = 6  # training steps per rank
N_VAL = 1001  # validation samples: not a multiple of W
VAL_BS = 10
# The collectives a metric sync can use. Not `broadcast`: Lightning 2.6.6 broadcasts a SIGTERM flag
# from rank 0 at every training step, with or without any metric.
_COUNTED = ("all_reduce", "all_gather", "all_gather_object", "barrier", "broadcast_object_list", "reduce")


def _value(rank: int, step: int, i: int = 0) -> float:
    return float(rank * 10 + step + 0.25 * i)


def _weight(rank: int, step: int) -> int:
    return 1 + rank * 3 + step % 2  # uneven batch sizes across ranks and steps


def _val_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N_VAL, 8, generator=g), torch.rand(N_VAL, generator=g))


class LoggingModel(SequentialRegressor):
    """Logs rank- and step-dependent numbers whose all-rank values are known in closed form."""

    def __init__(self):
        super().__init__()
        self.tm_mean = torchmetrics.MeanMetric()
        self.recorded = {"calls_at_step_start": []}

    def on_train_start(self):
        counts = self.recorded.setdefault("calls", [0])

        def counting(fn):
            def wrapped(*args, **kwargs):
                counts[0] += 1
                return fn(*args, **kwargs)

            return wrapped

        for name in _COUNTED:  # Python-level collectives only (DDP's gradient all-reduce is C++)
            setattr(dist, name, counting(getattr(dist, name)))

    def on_train_batch_start(self, batch, batch_idx):
        self.recorded["calls_at_step_start"].append(self.recorded["calls"][0])

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        r, k = self.global_rank, batch_idx
        self.log("w", _value(r, k), batch_size=_weight(r, k), on_step=True, on_epoch=True)
        self.log("tokens", float(r + k), reduce_fx="sum", on_step=True, on_epoch=True)
        self.log("peak_max", float(r * k), on_step=True, on_epoch=False)
        self.log("sd", _value(r, k), sync_dist=True, batch_size=_weight(r, k))  # no double reduction
        if r == 0 and k % 2 == 0:
            self.log("only0", float(k), sync_dist=True, on_step=True, on_epoch=False)  # would hang alone
        self.log_dict({f"m{i:02d}": _value(r, k, i) for i in range(32)}, batch_size=1)
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_rank", float(self.global_rank + 1), reduce_fx="sum")

    def validation_step(self, batch, batch_idx):
        _x, y = batch
        self.log("val_y", y.mean())  # batch size inferred from the batch
        self.log("val_y_sum", y.sum(), reduce_fx="sum")
        self.log("val_y_step", y.mean(), on_step=True, on_epoch=False)  # ranks run 51 and 50 batches
        self.tm_mean.update(y)
        self.log("val_tm", self.tm_mean)


def _rows(log_dir) -> list[dict[str, str]]:
    (path,) = glob.glob(os.path.join(str(log_dir), "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


def _column(rows, key) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def _train_loader() -> DataLoader:
    return loader(regression_data(n=W * STEPS * 4), 4)


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    torch.manual_seed(0)
    trainer = quiet_trainer(
        devices=W,
        strategy=ddp_spawn(),
        log_every_n_steps=1,
        logger=CSVLogger(str(tmp / "logs")),
        callbacks=[AllReducedMetrics(reduce={"*_max": "max"}, rank_stats=True), RankRecorder(tmp / "out")],
    )
    trainer.fit(LoggingModel(), _train_loader(), DataLoader(_val_data(), batch_size=VAL_BS))
    return _rows(tmp / "logs"), load_rank_results(tmp / "out", "fit")


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_step_and_epoch_values_are_exact_over_ranks(fit_run):
    rows, _ = fit_run
    ranks = range(W)
    for k in range(STEPS):
        weights = [_weight(r, k) for r in ranks]
        expect_w = sum(_value(r, k) * w for r, w in zip(ranks, weights)) / sum(weights)
        assert _column(rows, "w_step")[k] == pytest.approx(expect_w, rel=1e-6)
        assert _column(rows, "sd")[k] == pytest.approx(expect_w, rel=1e-6)
        assert _column(rows, "tokens_step")[k] == pytest.approx(sum(r + k for r in ranks))
        assert _column(rows, "peak_max")[k] == pytest.approx(max(r * k for r in ranks))
        assert _column(rows, "m31")[k] == pytest.approx(sum(_value(r, k, 31) for r in ranks) / W, rel=1e-6)
        if k % 2 == 0:
            assert _column(rows, "only0")[k] == pytest.approx(float(k))
    all_w = [(_value(r, k), _weight(r, k)) for r in ranks for k in range(STEPS)]
    (w_epoch,) = _column(rows, "w_epoch").values()
    assert w_epoch == pytest.approx(sum(v * w for v, w in all_w) / sum(w for _, w in all_w), rel=1e-6)
    (tokens_epoch,) = _column(rows, "tokens_epoch").values()
    assert tokens_epoch == pytest.approx(sum(r + k for r in ranks for k in range(STEPS)))
    (epoch_rank,) = _column(rows, "epoch_rank").values()
    assert epoch_rank == pytest.approx(sum(r + 1 for r in ranks))


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_one_collective_per_logging_step_with_32_metrics(fit_run):
    _, records = fit_run
    for record in records:
        starts = record["extra"]["calls_at_step_start"]
        per_step = [b - a for a, b in itertools.pairwise(starts)]
        # Step 0 also agrees the key set once (one object gather); every later step is one all_gather.
        assert per_step[0] <= 3, per_step  # gather, agree, gather
        assert per_step[1:] == [1] * (STEPS - 2), per_step


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_validation_of_1001_samples_on_2_ranks_is_exact(fit_run):
    rows, records = fit_run
    y = _val_data().tensors[1].double()
    (val_y,) = _column(rows, "val_y").values()
    assert val_y == pytest.approx(y.mean().item(), abs=1e-6)
    (val_sum,) = _column(rows, "val_y_sum").values()
    assert val_sum == pytest.approx(y.sum().item(), rel=1e-6)
    (val_tm,) = _column(rows, "val_tm").values()  # torchmetrics syncs itself: not reduced twice
    assert val_tm == pytest.approx(y.mean().item(), abs=1e-6)
    # Step values are reduced over the batches every rank runs (rank 0 has one batch more).
    assert len(_column(rows, "val_y_step")) == -(-(N_VAL // W + 1) // VAL_BS)
    for record in records:  # callback_metrics (what EarlyStopping reads) hold the same value on every rank
        assert record["callback_metrics"]["val_y"] == pytest.approx(y.mean().item(), abs=1e-6)
        assert record["callback_metrics"]["epoch_rank"] == pytest.approx(3.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_rank_stats_are_logged_as_min_mean_max(fit_run):
    rows, _ = fit_run
    for stat in ("step_time_s", "peak_mem_mb"):
        lo, mean, hi = (_column(rows, f"rank_stats/{stat}_{how}") for how in ("min", "mean", "max"))
        assert set(lo) == set(range(STEPS))
        for k in lo:
            assert 0 < lo[k] <= mean[k] <= hi[k]


def test_lightning_internals_are_where_we_expect():
    """AllReducedMetrics wraps private Lightning 2.6.6 state; fail loudly here if it moved."""
    import inspect

    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
    from lightning.pytorch.utilities.data import _update_dataloader

    assert callable(_update_dataloader)
    for cls, names in [
        (_ResultCollection, ["log", "metrics", "reset", "valid_items", "_forked_name"]),
        (
            _LoggerConnector,
            ["on_batch_end", "on_epoch_end", "epoch_end_reached", "update_eval_epoch_metrics"],
        ),
        (_DataConnector, ["_prepare_dataloader", "_requires_distributed_sampler"]),
    ]:
        for name in names:
            assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name} moved"
    log_params = inspect.signature(_ResultCollection.log).parameters
    assert {"sync_dist", "sync_dist_fn", "sync_dist_group", "batch_size", "add_dataloader_idx"} <= set(
        log_params
    )
    assert list(inspect.signature(_ResultCollection.metrics).parameters) == ["self", "on_step"]
    assert list(inspect.signature(_ResultCollection.reset).parameters) == ["self", "metrics", "fx"]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    loops = [trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop]
    assert all(isinstance(loop._results, _ResultCollection) for loop in [*loops, trainer.test_loop])
    results = _ResultCollection(training=True)
    assert results.batch is None and results.batch_size is None  # read by _lightning_batch_size
    assert callable(trainer.fit_loop._should_accumulate)
    assert isinstance(trainer._logger_connector.should_update_logs, bool)


def test_single_device_values_match_lightning_without_the_callback(tmp_path):
    """One process: the callback changes nothing (the all-rank value of one rank is its value)."""

    def run(callbacks, name):
        torch.manual_seed(0)
        trainer = quiet_trainer(
            devices=1, log_every_n_steps=1, logger=CSVLogger(str(tmp_path / name)), callbacks=callbacks
        )
        trainer.fit(SequentialRegressor(), loader(regression_data(n=40), 8), loader(regression_data(n=13), 4))
        return _rows(tmp_path / name)

    plain, reduced = run([], "plain"), run([AllReducedMetrics()], "reduced")
    for key in ("train_loss", "val_loss"):
        assert _column(reduced, key) == pytest.approx(_column(plain, key), rel=1e-6)


class MismatchedReduction(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        self.log("x", 1.0, reduce_fx="max" if self.global_rank else "mean")
        return super().training_step(batch, batch_idx)


class WriteException(L.Callback):
    def on_exception(self, trainer, pl_module, exception):
        with open(os.path.join(os.environ["ARM_TEST_DIR"], f"rank{trainer.global_rank}.txt"), "w") as f:
            f.write(str(exception))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_reduction_that_differs_across_ranks_fails_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ARM_TEST_DIR", str(tmp_path))
    trainer = quiet_trainer(
        devices=W,
        strategy=ddp_spawn(),
        log_every_n_steps=1,
        callbacks=[AllReducedMetrics(), WriteException()],
    )
    with pytest.raises(Exception, match="reduced differently on different ranks"):
        trainer.fit(MismatchedReduction(), _train_loader())
    messages = [p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))]
    assert messages and all("is reduced differently on different ranks" in m for m in messages)
