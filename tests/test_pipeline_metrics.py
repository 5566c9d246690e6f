"""torchmetrics Metrics and collectives in step methods under PipelineStrategy, against one device.

Every multi-process run shares one spawned job of 4 gloo ranks: each rank starts a Trainer per run, as
under torchrun, so the imports are paid once. The one-device references run in the test process.

Covers pipeline/_torchmetrics_internals.py (a Metric's step value), pipeline/step_scope.py (a world collective
in a step refused on every rank) and strategies/pipeline/step.py (the last stage's logs replayed on every
stage).
"""

from __future__ import annotations

import csv
import glob
import inspect
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from metric_models import CLASSES, MetricClassifier, MetricGPT, MetricTPGPT, class_data
from mp_harness import quiet_trainer, reference_loader, spawn_gloo
from tiny_models import SequentialRegressor, loader, regression_data, token_data
from torch import nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lightning_parallel import AllReducedMetrics, PipelineStrategy
from lightning_parallel.pipeline.metrics import BatchWindow
from lightning_parallel.pipeline.step_logs import LoggedMetric, LogRecorder, from_record, to_record

WORLD, GLOBAL_BATCH, VAL_BATCH, EPOCHS = 4, 16, 10, 2
TRAIN, VAL = class_data(64), class_data(40, seed=1)
TOKENS, TOKENS_VAL = token_data(32), token_data(20, seed=1)

# name -> (model, strategy options). The classifier's runs log AllReducedMetrics' values too.
RUNS = {
    "seq-pp2-dp2": (MetricClassifier, dict(pipeline_size=2)),
    "seq-zbv-dp2": (MetricClassifier, dict(pipeline_size=2, schedule="zbv")),  # the last stage on rank 0
    "seq-pp2-fsdp2": (MetricClassifier, dict(pipeline_size=2, data_parallel="fsdp")),
    "traced-pp2-dp2": (MetricGPT, dict(pipeline_size=2)),
    "seq-pp2-tp2": (MetricTPGPT, dict(pipeline_size=2, tensor_parallel_size=2)),
}
# Logged through AllReducedMetrics as a sum: were the callback to reduce a Metric, "seen" would double.
REDUCE = {"seen": "sum"}


def _data(model_cls):
    return (TRAIN, VAL) if model_cls is MetricClassifier else (TOKENS, TOKENS_VAL)


class Saved(Callback):
    """Every rank's callback_metrics at the end of fitting, and of testing, into ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.record = path, {}

    def on_fit_end(self, trainer, pl_module) -> None:
        self.record["fit"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.record["recorded"] = getattr(pl_module, "recorded", None)
        torch.save(self.record, self.path)

    def on_test_end(self, trainer, pl_module) -> None:
        self.record["test"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save(self.record, self.path)


class StepCollectives(MetricClassifier):
    """Gathers, reduces, broadcasts and computes a Metric inside its steps, and records what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded = {"gathered": [], "src": [], "acc_now": []}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # once per micro-batch on the last stage
        self.log("train_gathered", self.all_gather(loss.detach()).mean(), on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        strategy = self.trainer.strategy
        gathered = self.all_gather(loss)
        self.recorded["gathered"].append(tuple(gathered.shape))
        self.log("val_gathered", gathered.mean())
        self.log("val_reduced", strategy.reduce(loss.clone(), reduce_op="sum") / 2)  # reduce is in place
        strategy.barrier()
        self.recorded["src"].append(strategy.broadcast(self.global_rank))
        self.val_acc.update(logits, y)
        self.recorded["acc_now"].append(float(self.val_acc.compute()))  # synced over the replicas
        self.log("val_acc", self.val_acc)
        self.log("val_loss", loss, sync_dist=True)


class RawCollective(MetricClassifier):
    """Calls a torch.distributed collective over the world group in a step: before or after the model."""

    where = "validation_step-after"

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.where == "training_step-after":
            dist.barrier()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.where == "validation_step-before":
            dist.all_gather_object([None] * dist.get_world_size(), batch_idx)
        loss = F.cross_entropy(self(x), y)
        if self.where == "validation_step-after":
            dist.all_reduce(loss)
        self.log("val_loss", loss)


def _trainer(out: Path, name: str, strategy, callbacks=(), **kwargs):
    return quiet_trainer(
        devices=WORLD if strategy is not None else 1, strategy=strategy or "auto", max_epochs=EPOCHS,
        log_every_n_steps=1, logger=CSVLogger(out / name, name="", version=""),
        callbacks=[*callbacks, Saved(str(out / f"{name}-rank{_rank()}.pt"))], **kwargs,
    )  # fmt: skip


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _run(out: Path, name: str, model_cls, options: dict | None) -> None:
    """Fit, then test; ``options`` None: one device, the reference."""
    train, val = _data(model_cls)
    shape = 1 if options is None else options["pipeline_size"] * options.get("tensor_parallel_size", 1)
    dp = 1 if options is None else WORLD // shape
    torch.manual_seed(0)
    model = model_cls()
    strategy = None if options is None else PipelineStrategy(num_microbatches=2, **options)
    callbacks = [AllReducedMetrics(reduce=REDUCE)] if model_cls is MetricClassifier else []
    trainer = _trainer(out, name, strategy, callbacks)
    batches = reference_loader(train, GLOBAL_BATCH) if options is None else loader(train, GLOBAL_BATCH // dp)
    trainer.fit(model, batches, loader(val, VAL_BATCH // dp))
    if model_cls is MetricClassifier:
        trainer.test(model, loader(val, VAL_BATCH // dp))
        if name.startswith("seq-pp2-dp2"):
            _checkpoint_round_trip(out, name, trainer, dp)


def _checkpoint_round_trip(out: Path, name: str, trainer, dp: int) -> None:
    """Save from user code, then restore into a fresh module under a new Trainer: the Metric state too."""
    path = out / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    restored = MetricClassifier()
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2) if dp > 1 else "auto"
    quiet_trainer(devices=WORLD if dp > 1 else 1, strategy=strategy).validate(
        restored, loader(VAL, VAL_BATCH // dp), ckpt_path=path
    )
    torch.save(float(restored.seen.sum_value), out / f"{name}-restored-rank{_rank()}.pt")


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    out = Path(out_dir)
    for name, (model_cls, options) in RUNS.items():
        _run(out, name, model_cls, options)
    # A collective over the world group in a step: refused on every rank, whichever stage runs it.
    for where in ("validation_step-after", "validation_step-before", "training_step-after"):
        model = RawCollective()
        model.where = where
        try:
            _trainer(out, f"raw-{where}", PipelineStrategy(pipeline_size=2, num_microbatches=2)).fit(
                model, loader(TRAIN, 8), loader(VAL, 5)
            )
            outcome = None
        except Exception as err:
            outcome = (type(err).__name__, str(err), getattr(err, "__notes__", []))
        torch.save(outcome, out / f"raw-{where}-rank{rank}.pt")
    # ... and the step's own collectives run over the last stage's data-parallel ranks (after the refusals:
    # the processes carry on).
    torch.manual_seed(0)
    trainer = _trainer(out, "collectives", PipelineStrategy(pipeline_size=2, num_microbatches=2))
    trainer.fit(StepCollectives(), loader(TRAIN, 8), loader(VAL, 5))
    for name, pipeline_size in ADVICE_RUNS.items():
        _advice_run(out, name, pipeline_size, rank)
    torch.save({}, out / f"rank{rank}.pt")


# Lightning's advice to log epoch values with sync_dist=True (rank 0 gives it): one replica of 4 stages,
# where every rank logs the last stage's value, and 2 replicas of 2 stages, whose values differ.
ADVICE_RUNS = {"advice_pp4": 4, "advice_pp2_dp2": 2}
ADVICE = "when logging on epoch level in distributed setting"


class PlainEpochLog(SequentialRegressor):
    """Logs its validation loss without sync_dist, under a name of its own (Lightning gives each name's
    advice once per process)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.log_name = name

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log(self.log_name, F.mse_loss(self(x), y))


def _advice_run(out: Path, name: str, pipeline_size: int, rank: int | None) -> None:
    """Validate a plain MLP; ``rank`` None: on one device. Saves the advice given and the value logged."""
    torch.manual_seed(0)
    model, dp = PlainEpochLog(name), WORLD // pipeline_size
    strategy = (
        PipelineStrategy(pipeline_size=pipeline_size, num_microbatches=2) if rank is not None else "auto"
    )
    trainer = quiet_trainer(devices=WORLD if rank is not None else 1, strategy=strategy)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        trainer.validate(model, loader(regression_data(16), 8 // dp if rank is not None else 8))
    advice = [str(w.message) for w in shown if ADVICE in str(w.message)]
    torch.save((advice, float(trainer.callback_metrics[name])), out / f"{name}-rank{rank or 0}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("metrics")
    for name, (model_cls, _) in RUNS.items():
        if name in ("seq-pp2-dp2", "traced-pp2-dp2", "seq-pp2-tp2"):
            _run(out, f"{name}-ref", model_cls, None)
    spawn_gloo(_job, WORLD, out)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_lightning_advises_sync_dist_only_where_the_replicas_values_differ(runs, tmp_path):
    """One replica: every rank logs the last stage's value (the strategy logs it as synced, over the
    replica group of one rank), which is one device's, and Lightning gives no advice. Two replicas:
    each logs its own half's value, and Lightning advises sync_dist=True, rightly."""
    one_replica, two_replicas = ADVICE_RUNS
    _advice_run(tmp_path, one_replica, 1, None)
    _, reference = torch.load(tmp_path / f"{one_replica}-rank0.pt")
    for rank in range(WORLD):
        advice, value = torch.load(runs / f"{one_replica}-rank{rank}.pt")
        assert advice == [] and value == pytest.approx(reference, rel=1e-6), (rank, advice, value)
    advice, _ = torch.load(runs / f"{two_replicas}-rank0.pt")
    assert len(advice) == 1 and f"self.log({two_replicas!r}, ..., sync_dist=True)" in advice[0], advice


def _rows(out: Path, name: str) -> dict[tuple[int, str], float]:
    (path,) = glob.glob(str(out / name / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {(int(r["step"]), k): float(v) for r in rows for k, v in r.items() if v and k != "step"}


def _reference_of(name: str) -> str:
    return (name if name in ("seq-pp2-tp2", "traced-pp2-dp2") else "seq-pp2-dp2") + "-ref"


def _close(got: float, expected: float, what: str) -> None:
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), f"{what}: {got} != {expected} (one device)"


METRIC_COLUMNS = {
    MetricClassifier: [
        "train_acc_step", "train_acc_epoch", "train_nll", "seen", "train_loss",
        "val_acc", "val_auroc", "val_f1", "val_prec", "val_mean", "val_loss", "test_acc",
    ],
    MetricGPT: ["train_ppl_step", "train_ppl_epoch", "train_loss", "val_ppl", "val_tok_acc"],
    MetricTPGPT: ["train_ppl_step", "train_ppl_epoch", "train_loss", "val_ppl", "val_tok_acc"],
}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(RUNS))
def test_logged_metrics_equal_one_device_at_every_step_and_epoch(runs, name):
    """Accuracy, running means, perplexity, AUROC (list states), a collection, on both split paths."""
    model_cls = RUNS[name][0]
    ref, got = _rows(runs, _reference_of(name)), _rows(runs, name)
    columns = METRIC_COLUMNS[model_cls]
    for column in columns:
        expected = {k: v for k, v in ref.items() if k[1] == column}
        assert expected, f"the reference logged no {column}"
        assert sorted(k for k in got if k[1] == column) == sorted(expected), column
        for key, value in expected.items():
            _close(got[key], value, f"{name} {key}")
    # Every rank ends with the same values as one device (what EarlyStopping and ModelCheckpoint read).
    ref_record = torch.load(runs / f"{_reference_of(name)}-rank0.pt")
    for rank in range(WORLD):
        record = torch.load(runs / f"{name}-rank{rank}.pt")
        for stage in ("fit", "test") if model_cls is MetricClassifier else ("fit",):
            assert set(record[stage]) == set(ref_record[stage])
            for key, value in ref_record[stage].items():
                _close(record[stage][key], value, f"{name} rank {rank} {stage} {key}")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_metric_state_is_saved_from_the_last_stage_and_restored(runs):
    """A persistent Metric state in the consolidated checkpoint is the last stage's, as Lightning saves it.

    One device holds every sample; under data parallelism Lightning saves global rank 0's own state (not
    synced), here replica 0's last stage's: half the samples for 2 replicas. Every rank restores it.
    """
    expected = torch.load(runs / "seq-pp2-dp2-ref.ckpt", weights_only=False)["state_dict"]["seen.sum_value"]
    saved = torch.load(runs / "seq-pp2-dp2.ckpt", weights_only=False)["state_dict"]["seen.sum_value"]
    assert float(expected) == EPOCHS * len(TRAIN) and float(saved) == float(expected) / 2
    assert torch.load(runs / "seq-pp2-dp2-ref-restored-rank0.pt") == float(expected)
    for rank in range(WORLD):
        assert torch.load(runs / f"seq-pp2-dp2-restored-rank{rank}.pt") == float(saved)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["validation_step-after", "validation_step-before", "training_step-after"])
def test_a_world_collective_in_a_step_is_refused_on_every_rank(runs, where):
    outcomes = [torch.load(runs / f"raw-{where}-rank{r}.pt") for r in range(WORLD)]
    name = "barrier" if where.startswith("training") else "all_reduce"
    name = "all_gather_object" if where.endswith("before") else name
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} ran a world collective in a step without an error"
        kind, message, notes = outcome
        assert kind == "CollectiveOutsideStepError", outcome
        assert f"torch.distributed.{name} was called in a step over ranks that do not run it" in message
        assert "self.all_gather" in message and "group=self.trainer.strategy.data_parallel_group" in message
        if rank < 2:  # the first stage did not run the failing code: it raises the last stage's error
            assert any("raised on global rank" in n for n in notes), notes


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_collectives_in_steps_run_over_the_last_stages_replicas(runs):
    rows, ref = _rows(runs, "collectives"), _rows(runs, "seq-pp2-dp2-ref")
    for (step, key), value in rows.items():
        if key == "train_gathered":  # per micro-batch, over both replicas: the global batch's mean loss
            _close(value, rows[(step, "train_loss")], f"step {step} {key}")
            _close(value, ref[(step, "train_loss")], f"step {step} {key} (one device)")
        if key in ("val_gathered", "val_reduced"):  # means of per-replica means, equal batch sizes
            _close(value, rows[(step, "val_loss")], f"step {step} {key}")
    for step in {s for s, k in ref if k == "val_acc"}:
        _close(rows[(step, "val_acc")], ref[(step, "val_acc")], f"val_acc at step {step}")
        _close(rows[(step, "val_loss")], ref[(step, "val_loss")], f"val_loss at step {step}")
    last_stage = [torch.load(runs / f"collectives-rank{r}.pt")["recorded"] for r in (2, 3)]
    for recorded in last_stage:
        assert set(recorded["gathered"]) == {(2,)}  # the two replicas of the last stage
        assert set(recorded["src"]) == {2}  # broadcast from the step group's first rank
    # A Metric computed in the step syncs over the same ranks: at an epoch's last batch, the epoch's value.
    acc_now = last_stage[0]["acc_now"]
    assert acc_now == last_stage[1]["acc_now"]
    per_epoch = len(VAL) // 2 // 5  # each replica's batches of 5
    epoch_ends = acc_now[-EPOCHS * per_epoch :][per_epoch - 1 :: per_epoch]  # after the sanity check's
    assert [round(a, 6) for a in epoch_ends] == [
        round(v, 6) for (s, k), v in sorted(ref.items()) if k == "val_acc"
    ]
    for rank in range(2):  # the first stage never ran the step: nothing recorded there
        assert torch.load(runs / f"collectives-rank{rank}.pt")["recorded"]["gathered"] == []


# ------------------------------------------------------------------------ pure logic, no processes


def test_a_batch_window_gives_each_metric_its_value_over_the_micro_batches():
    g = torch.Generator().manual_seed(0)
    preds, target = torch.randn(12, CLASSES, generator=g), torch.randint(0, CLASSES, (12,), generator=g)
    acc, auroc = MulticlassAccuracy(CLASSES, average="micro"), MulticlassAUROC(CLASSES)
    one_call = MulticlassAccuracy(CLASSES, average="micro")
    window = BatchWindow([acc, auroc])
    for start in (0, 6):  # two batches of two micro-batches
        window = BatchWindow([acc, auroc], window.twins)
        with window.collecting():
            for lo in (start, start + 3):
                acc(preds[lo : lo + 3], target[lo : lo + 3])
                auroc.update(preds[lo : lo + 3].softmax(-1), target[lo : lo + 3])
        window.finish()
        batch = one_call(preds[start : start + 6], target[start : start + 6])
        assert acc._forward_cache == batch  # the batch's value, not its last micro-batch's
    assert "forward" not in vars(acc)  # the window's stand-in is gone
    assert acc.compute() == one_call.compute()  # the running state saw every micro-batch once
    assert auroc._forward_cache is None  # updated, never called: no step value, as on one device


def test_a_logged_metric_travels_as_its_path_and_step_value():
    module = nn.Module()
    module.acc = MulticlassAccuracy(CLASSES, average="micro")
    recorder = LogRecorder()
    with recorder.recording(module, 4):
        module.acc(torch.eye(CLASSES)[:2], torch.tensor([0, 2]))
        module.log("acc", module.acc, on_step=True, prog_bar=True)
        module.log("loss", 0.5)
    layout, values = to_record(recorder.entries(), 1.25)
    leading, logs = from_record(layout, values, leading=1)
    assert leading == [1.25]
    assert logs == [
        ("acc", LoggedMetric("acc", 0.5), {"on_step": True, "prog_bar": True}),
        ("loss", 0.5, {}),
    ]
    module.acc.reset()  # no step value: sent as such
    _, logs = from_record(*to_record(recorder.entries()))
    assert logs[0][1] == LoggedMetric("acc", None)
    stray = MulticlassAccuracy(CLASSES)
    with recorder.recording(module, 1), pytest.raises(TypeError, match="not held by the LightningModule"):
        module.log("stray", stray)
    with recorder.recording(module, 1), pytest.raises(TypeError, match=r"self.log_dict\(collection\)"):
        module.log("set", torchmetrics.MetricCollection([MulticlassAccuracy(CLASSES)]))


def test_torchmetrics_internals_are_where_we_expect():
    """The pipeline sets a Metric's step value through torchmetrics' private ``_forward_cache``."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    metric = torchmetrics.MeanMetric()
    assert metric._forward_cache is None
    assert float(metric(torch.tensor([2.0, 4.0]))) == float(metric._forward_cache) == 3.0
    metric.reset()
    assert metric._forward_cache is None
    assert "value._forward_cache" in inspect.getsource(_ResultMetric.update)  # what Lightning logs on step
    assert callable(metric.dist_sync_fn or torchmetrics.utilities.distributed.gather_all_tensors)
    assert "distributed_available_fn" in vars(metric) and "dist_sync_fn" in vars(metric)
