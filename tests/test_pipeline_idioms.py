"""Lightning's everyday idioms under PipelineStrategy (2 stages x 2 replicas), against one device.

Each works, or is refused at setup with the fix; docs/pipeline.md's idioms table lists them. One spawned
job of 4 gloo ranks runs every Trainer (each rank starts its own, as under torchrun); the one-device
references run in the test process. Covers strategies/pipeline/collectives.py (Lightning's collectives
in a step, routed to the step's data-parallel ranks).
"""

from __future__ import annotations

import csv
import glob
import inspect
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import AdvancedProfiler, SimpleProfiler
from lightning.pytorch.tuner import Tuner
from metric_models import MetricClassifier, class_data
from mp_harness import assert_close_dicts, quiet_trainer, reference_loader, spawn_gloo
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import PipelineStrategy
from lightning_parallel.techniques.overlap import BucketedAverage

WORLD, REPLICAS, GLOBAL_BATCH, VAL_BATCH, MAX_EPOCHS = 4, 2, 16, 10, 6
TRAIN, VAL = class_data(64), class_data(40, seed=1)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ClassData(L.LightningDataModule):
    """prepare_data leaves a file per call (made on local rank 0 only); setup records its stages."""

    def __init__(self, out: Path, replicas: int) -> None:
        super().__init__()
        self.out, self.replicas, self.stages = out, replicas, []

    def prepare_data(self) -> None:
        (self.out / "prepared").mkdir(exist_ok=True)
        (self.out / "prepared" / f"{os.getpid()}-{len(os.listdir(self.out / 'prepared'))}").touch()

    def setup(self, stage: str) -> None:
        self.stages.append(stage)

    def train_dataloader(self):
        if self.replicas == 1:  # one device: the batches the replicas see together, in the same order
            return reference_loader(TRAIN, GLOBAL_BATCH)
        return loader(TRAIN, GLOBAL_BATCH // self.replicas)

    def val_dataloader(self):
        return loader(VAL, VAL_BATCH // self.replicas)

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return loader(VAL, VAL_BATCH // self.replicas)


class Walkthrough(MetricClassifier):
    """A scheduler, gradients read before each optimizer step, a checkpoint saved from the module's code."""

    out = Path()  # where on_train_epoch_end saves (not an __init__ argument: not a hyper-parameter)

    def __init__(self) -> None:
        super().__init__(lr=0.5)
        self.recorded = {}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.trainer.global_step == 0:  # this rank's stage's gradients, reduced over the replicas
            self.recorded["grads"] = {
                n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None
            }

    def on_train_epoch_end(self) -> None:
        self.trainer.save_checkpoint(self.out / f"user-epoch{self.current_epoch}.ckpt")


class RecordedSummary(ModelSummary):
    """The callback Lightning adds, recording what it would print."""

    def summarize(self, summary_data, total_parameters, trainable_parameters, *args, **kwargs) -> None:
        self.printed = (total_parameters, trainable_parameters, dict(summary_data)["Params"])


class Saved(Callback):
    def __init__(self) -> None:
        self.record = {}

    def on_fit_end(self, trainer, pl_module) -> None:
        # Read here: validate(ckpt_path="best") restores the callbacks' state of the best checkpoint.
        stopping = trainer.early_stopping_callback
        self.record["stopped"] = (trainer.current_epoch, stopping.stopped_epoch if stopping else None)
        if isinstance(trainer.profiler, (SimpleProfiler, AdvancedProfiler)):  # cleared at teardown
            self.record["profile"] = trainer.profiler.summary() if trainer.is_global_zero else ""


def _walkthrough(out: Path, replicas: int) -> dict:
    """Fit with the everyday callbacks, then validate / test / predict the best checkpoint."""
    torch.manual_seed(0)
    model, data = Walkthrough(), ClassData(out, replicas)
    model.out = out
    summary, saved = RecordedSummary(max_depth=1), Saved()
    stopping = EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.02)
    best = ModelCheckpoint(dirpath=out / "best", monitor="val_acc", mode="max", save_top_k=1)
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2) if replicas > 1 else "auto"
    trainer = quiet_trainer(
        devices=WORLD if replicas > 1 else 1, strategy=strategy, max_epochs=MAX_EPOCHS, log_every_n_steps=1,
        logger=CSVLogger(out / "logs", name="", version=""), enable_checkpointing=True,
        enable_model_summary=True, callbacks=[LearningRateMonitor(), stopping, best, summary, saved],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(out / "user-after-fit.ckpt")  # user code after fit, on every rank
    validated = trainer.validate(datamodule=data, ckpt_path="best")
    tested = trainer.test(datamodule=data, ckpt_path="best")
    predicted = trainer.predict(datamodule=data, ckpt_path="best")
    return {
        "summary": summary.printed if trainer.is_global_zero else None,
        "stopped": saved.record["stopped"],
        "best": (os.path.basename(best.best_model_path), float(best.best_model_score)),
        "validated": validated,
        "tested": tested,
        "predicted": torch.cat(predicted).tolist() if trainer.is_global_zero else None,
        "grads": model.recorded["grads"],
        "setup": data.stages,
    }


def _profiled(out: Path, profiler: str) -> str:
    saved = Saved()  # reads the profiler's summary when fitting ends (Lightning clears it at teardown)
    trainer = quiet_trainer(
        devices=WORLD, strategy=PipelineStrategy(pipeline_size=2, num_microbatches=2), max_steps=2,
        profiler=profiler, default_root_dir=out / profiler, callbacks=[saved],
    )  # fmt: skip
    trainer.fit(MetricClassifier(), loader(TRAIN, 8))
    if profiler == "pytorch":  # its events outlive the fit; they name what Lightning ran, not the step
        return "\n".join(sorted({e.name for e in trainer.profiler.function_events or []}))
    return saved.record["profile"]


def _lr_find(out: Path, pipelined: bool) -> dict:
    """4 stages, one replica: the losses the finder reads (global rank 0's, as under DDP) are one device's."""
    torch.manual_seed(0)
    model = MetricClassifier()
    strategy = PipelineStrategy(pipeline_size=4, num_microbatches=2) if pipelined else "auto"
    trainer = quiet_trainer(
        devices=WORLD if pipelined else 1, strategy=strategy, max_epochs=3, default_root_dir=out / "lr"
    )
    batches = loader(TRAIN, GLOBAL_BATCH) if pipelined else reference_loader(TRAIN, GLOBAL_BATCH)
    found = Tuner(trainer).lr_find(model, batches, num_training=12, min_lr=1e-3, max_lr=10.0)
    return {"loss": found.results["loss"], "lr": found.results["lr"], "suggestion": found.suggestion(2, 1)}


def _refusals(out: Path) -> dict:
    """What each refused idiom raises (on every rank, at setup: before any collective)."""

    def fit(callback) -> None:
        trainer = quiet_trainer(
            devices=WORLD, strategy=PipelineStrategy(pipeline_size=2), max_epochs=1, callbacks=[callback]
        )
        trainer.fit(MetricClassifier(), loader(TRAIN, 8))

    def scale_batch_size() -> None:
        trainer = quiet_trainer(devices=WORLD, strategy=PipelineStrategy(pipeline_size=2), max_epochs=1)
        Tuner(trainer).scale_batch_size(MetricClassifier(), loader(TRAIN, 8))

    attempts = {
        "StochasticWeightAveraging": lambda: fit(StochasticWeightAveraging(swa_lrs=0.1)),
        "EMAWeightAveraging": lambda: fit(EMAWeightAveraging()),
        "BatchSizeFinder": lambda: fit(BatchSizeFinder()),
        "Tuner.scale_batch_size": scale_batch_size,
    }
    outcomes = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            outcomes[name] = None
        except Exception as err:
            outcomes[name] = f"{type(err).__name__}: {err}"
    return outcomes


class _BucketsStarted(Callback):
    def __init__(self) -> None:
        self.started = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        reductions = trainer.strategy._sync.reductions
        self.started += [(r.started, len(r.buckets)) for r in reductions if isinstance(r, BucketedAverage)]


def _overlapped(out: Path) -> dict:
    """The overlapped all-reduce on and off, bitwise: 2 stages x 2 replicas (fp32) and 4 replicas of one
    stage (bf16 buckets; gloo's ring sums >2 ranks in an order that depends on the layout, the same in
    both); accumulation over 2 batches (its last one short), clipping, tiny buckets (one per tensor)."""
    runs = {}
    for pipeline_size, precision in ((2, "32-true"), (1, "bf16-true")):
        for on in (True, False):
            torch.manual_seed(0)
            model, started = SequentialRegressor(), _BucketsStarted()
            strategy = PipelineStrategy(pipeline_size=pipeline_size, num_microbatches=2, bucket_cap_mb=1e-6,
                                        overlap_gradient_reduction=on)  # fmt: skip
            trainer = quiet_trainer(
                devices=WORLD, strategy=strategy, accumulate_grad_batches=2, precision=precision,
                gradient_clip_val=0.05, callbacks=[started], default_root_dir=out / "overlap",
            )  # fmt: skip
            trainer.fit(model, loader(regression_data(40), 4))
            params = {k: v.detach().clone() for k, v in model.state_dict().items()}
            runs[(pipeline_size, on)] = (params, started.started)
    return runs


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    out = Path(out_dir)
    record = {"walkthrough": _walkthrough(out / "pp", REPLICAS)}
    record["profilers"] = {p: _profiled(out, p) for p in ("simple", "advanced", "pytorch")}
    record["lr_find"] = _lr_find(out / "pp", pipelined=True)
    record["refused"] = _refusals(out)
    record["overlapped"] = _overlapped(out)
    torch.save(record, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    out = tmp_path_factory.mktemp("idioms")
    (out / "pp").mkdir()
    (out / "ref").mkdir()
    ref = {"walkthrough": _walkthrough(out / "ref", 1), "lr_find": _lr_find(out / "ref", pipelined=False)}
    return ref, spawn_gloo(_job, WORLD, out), out


def _logged(log_dir: Path, key: str) -> list[tuple[int, float]]:
    (path,) = glob.glob(str(log_dir / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_learning_rate_monitor_and_early_stopping_act_as_on_one_device(runs):
    ref, records, out = runs
    lrs = _logged(out / "ref" / "logs", "lr-SGD")
    assert len(lrs) > 1 and _logged(out / "pp" / "logs", "lr-SGD") == lrs  # logged from global rank 0
    stopped = ref["walkthrough"]["stopped"]
    assert 0 < stopped[1] < MAX_EPOCHS - 1, stopped  # EarlyStopping stopped the reference early
    for record in records:  # on a Metric's epoch value, the same on every rank
        assert record["walkthrough"]["stopped"] == stopped


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_model_summary_counts_the_whole_model(runs):
    ref, records, _ = runs
    total, trainable, params = records[0]["walkthrough"]["summary"]
    assert (total, trainable, params) == ref["walkthrough"]["summary"]
    assert total == sum(p.numel() for p in MetricClassifier().parameters())


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_validate_test_and_predict_the_best_checkpoint(runs):
    ref, records, _ = runs
    expected = ref["walkthrough"]
    for record in records:
        got = record["walkthrough"]
        assert got["best"][0] == expected["best"][0]  # the same epoch's file
        assert got["best"][1] == pytest.approx(expected["best"][1], abs=1e-6)
        for stage in ("validated", "tested"):
            (values,) = got[stage]
            assert set(values) == set(expected[stage][0])
            for key, value in values.items():
                assert value == pytest.approx(expected[stage][0][key], rel=1e-5, abs=1e-6), (stage, key)
    # Predictions come back on global rank 0, in the dataset's order.
    assert records[0]["walkthrough"]["predicted"] == expected["predicted"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_checkpoints_saved_from_user_code_hold_the_whole_model(runs):
    _, _, out = runs
    names = sorted(os.path.basename(p) for p in glob.glob(str(out / "ref" / "user-*.ckpt")))
    assert "user-after-fit.ckpt" in names and "user-epoch0.ckpt" in names
    assert sorted(os.path.basename(p) for p in glob.glob(str(out / "pp" / "user-*.ckpt"))) == names
    for name in names:
        expected = torch.load(out / "ref" / name, weights_only=False)
        got = torch.load(out / "pp" / name, weights_only=False)
        params = {
            k: v for k, v in expected["state_dict"].items() if not k.startswith(("train_", "val_", "seen"))
        }
        assert_close_dicts({k: got["state_dict"][k] for k in params}, params)
        assert got["epoch"] == expected["epoch"] and got["global_step"] == expected["global_step"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gradients_seen_before_the_optimizer_step_are_the_stages_own(runs):
    ref, records, _ = runs
    expected = ref["walkthrough"]["grads"]
    for rank, record in enumerate(records):
        grads = record["walkthrough"]["grads"]
        stage = 0 if rank < REPLICAS else 1
        assert grads and all(k.startswith("layers.") for k in grads)
        held = {k.split(".")[1] for k in grads}
        assert held == ({"0", "1"} if stage == 0 else {"2", "3"}), held
        assert_close_dicts(grads, {k: expected[k] for k in grads})


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_datamodule_prepares_once_per_run_and_sets_up_on_every_rank(runs):
    _, records, out = runs
    # fit, validate, test and predict each prepare once, on local rank 0 (all 4 ranks share this node)
    assert len(os.listdir(out / "pp" / "prepared")) == 4
    for record in records:
        assert record["walkthrough"]["setup"] == ["fit", "validate", "test", "predict"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_profilers_time_the_pipelined_steps(runs):
    _, records, _ = runs
    profiled = records[0]["profilers"]
    assert "PipelineStrategy.training_step" in profiled["simple"]
    assert "PipelineStrategy.training_step" in profiled["advanced"]
    # torch's profiler records the hooks around the step (one device's record the same kinds)
    assert "[pl][profile][Strategy]PipelineStrategy.backward" in profiled["pytorch"].splitlines()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_learning_rate_finder_sees_one_devices_losses(runs):
    ref, records, _ = runs
    for record in records:
        got = record["lr_find"]
        assert got["lr"] == pytest.approx(ref["lr_find"]["lr"])
        assert got["loss"] == pytest.approx(ref["lr_find"]["loss"], rel=1e-4)
        assert got["suggestion"] == pytest.approx(ref["lr_find"]["suggestion"])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_weight_averaging_and_batch_size_finding_are_refused_with_the_fix(runs):
    _, records, _ = runs
    for record in records:
        refused = record["refused"]
        for name in ("StochasticWeightAveraging", "EMAWeightAveraging"):
            assert refused[name].startswith(f"ValueError: {name} is not supported under PipelineStrategy")
            assert "average the weights offline" in refused[name]
        assert "Tuner(L.Trainer(devices=1)).scale_batch_size(model)" in refused["BatchSizeFinder"]
        # Lightning refuses the Tuner's batch-size search for every distributed strategy, before launching.
        assert "not supported with distributed strategies" in refused["Tuner.scale_batch_size"]


def test_summary_internals_are_where_we_expect():
    """strategies/pipeline/summary.py replaces ModelSummary's private _summary per instance (Lightning
    2.6.6)."""
    from lightning.pytorch.utilities.model_summary import summarize

    callback = ModelSummary(max_depth=2)
    assert callback._max_depth == 2
    assert list(inspect.signature(ModelSummary._summary).parameters) == ["self", "trainer", "pl_module"]
    source = inspect.getsource(ModelSummary.on_fit_start)
    assert "self._summary(trainer, pl_module)" in source and "_get_summary_data()" in source
    summary = summarize(MetricClassifier(), max_depth=1)
    for name in (
        "total_parameters",
        "trainable_parameters",
        "model_size",
        "total_training_modes",
        "total_flops",
    ):
        getattr(summary, name)
    assert summary._get_summary_data()[1][0] == "Name"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_overlapped_all_reduce_gives_the_same_weights_bitwise_as_after_the_schedule(runs):
    _, records, _ = runs
    for record in records:
        runs_ = record["overlapped"]
        for pipeline_size in (2, 1):
            (on, started_on), (off, started_off) = runs_[(pipeline_size, True)], runs_[(pipeline_size, False)]
            assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on), pipeline_size
            # Optimizer steps of 2 batches and a last one of 1 (2 replicas: 5 batches; 4: 3): every bucket
            # of every step started during its last backward; switched off, none.
            steps = 3 if pipeline_size == 2 else 2
            assert len(started_on) == steps and all(n == b > 1 for n, b in started_on), started_on
            assert [n for n, _ in started_off] == [0] * steps
