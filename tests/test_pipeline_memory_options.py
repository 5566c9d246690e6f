"""PipelineStrategy(shard_optimizer_state=..., activation_checkpointing=...) against one device."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from mp_harness import (
    START_METHOD,
    RankRecorder,
    assert_close_dicts,
    load_rank_results,
    merged_params,
    quiet_trainer,
    reference_loader,
)
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy
from lightning_parallel.optim.sharded import is_sharded, local_state_bytes
from lightning_parallel.techniques.recompute import is_checkpointed

# 48 samples, global batch 16: 3 optimizer steps per epoch, so an epoch boundary is a clean resume point.
N_SAMPLES, GLOBAL_BATCH = 48, 16


class ScheduledAdamW(SequentialRegressor):
    """AdamW with a per-step LR schedule: the scheduler must drive the sharded optimizer."""

    def __init__(self):
        super().__init__(hidden=32, depth=5, adam=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RecordOptimizer(Callback):
    """What each rank's optimizer is after setup, and the state bytes it holds after training."""

    def on_train_start(self, trainer, pl_module):
        pl_module.recorded = {"sharded": is_sharded(trainer.optimizers[0])}

    def on_train_end(self, trainer, pl_module):
        pl_module.recorded["state_bytes"] = local_state_bytes(trainer.optimizers[0])
        pl_module.recorded["checkpointed"] = [
            n for n, m in pl_module.layers.named_children() if is_checkpointed(m)
        ]


class SaveAtEpochEnd(Callback):
    def __init__(self, path):
        self.path = str(path)

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)  # every rank calls it: the optimizer state is consolidated


def fit(model, train_dataloaders, out_dir, devices, strategy="auto", ckpt_path=None, **trainer_kwargs):
    """mp_harness.fit with ``ckpt_path`` (a resumed run)."""
    callbacks = [*trainer_kwargs.pop("callbacks", []), RankRecorder(out_dir)]
    trainer = quiet_trainer(devices=devices, strategy=strategy, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(model, train_dataloaders=train_dataloaders, ckpt_path=ckpt_path)
    return load_rank_results(out_dir, "fit")


def _reference(tmp_path, name, epochs, **kwargs):
    torch.manual_seed(0)
    data = regression_data(N_SAMPLES)
    return fit(
        ScheduledAdamW(), reference_loader(data, GLOBAL_BATCH), tmp_path / name, devices=1,
        max_epochs=epochs, gradient_clip_val=0.5, **kwargs,
    )[0]  # fmt: skip


def _pipeline(tmp_path, name, devices, epochs, **kwargs):
    torch.manual_seed(0)
    strategy_kwargs = dict(pipeline_size=2, num_microbatches=4, start_method=START_METHOD)
    strategy_kwargs.update(kwargs.pop("strategy_kwargs", {}))
    dp = devices // strategy_kwargs["pipeline_size"]
    return fit(
        ScheduledAdamW(), loader(regression_data(N_SAMPLES), GLOBAL_BATCH // dp), tmp_path / name,
        devices=devices, strategy=PipelineStrategy(**strategy_kwargs), max_epochs=epochs,
        gradient_clip_val=0.5, **kwargs,
    )  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sharded_optimizer_2x2_matches_one_device_and_halves_the_state(tmp_path):
    ref = _reference(tmp_path, "ref", epochs=2)
    records = _pipeline(
        tmp_path, "zero", devices=4, epochs=2, callbacks=[RecordOptimizer()],
        strategy_kwargs=dict(shard_optimizer_state=True),
    )  # fmt: skip
    assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor([r["losses"] for r in records]).mean(0),
        torch.tensor(ref["losses"]),
        rtol=1e-5,
        atol=1e-6,
    )
    assert all(r["extra"]["sharded"] for r in records)
    # The two replicas of a stage split its AdamW state: together they hold it once.
    for stage in (0, 1):
        replicas = [records[2 * stage + r]["extra"]["state_bytes"] for r in (0, 1)]
        stage_params = sum(v.numel() for v in records[2 * stage]["params"].values())
        steps = 4 * len(records[2 * stage]["params"])  # AdamW's fp32 step scalar per tensor
        assert sum(replicas) == 8 * stage_params + steps
        assert max(replicas) < 8 * stage_params


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_at_other_shapes_and_a_full_one_loads_sharded(tmp_path):
    ref = _reference(tmp_path, "ref", epochs=2)
    # 2 stages x 2 replicas, sharded, one epoch -> a checkpoint with the whole optimizer state.
    sharded_ckpt = tmp_path / "sharded.ckpt"
    _pipeline(
        tmp_path, "zero", devices=4, epochs=1, callbacks=[SaveAtEpochEnd(sharded_ckpt)],
        strategy_kwargs=dict(shard_optimizer_state=True),
    )  # fmt: skip
    saved = torch.load(sharded_ckpt, weights_only=False)["optimizer_states"][0]
    assert len(saved["state"]) == len(ref["params"])  # every parameter's state, not replica 0's shard
    # ... resumed on one device, without PipelineStrategy.
    resumed = _reference(tmp_path, "resumed", epochs=2, ckpt_path=str(sharded_ckpt))
    assert_close_dicts(resumed["params"], ref["params"], rtol=1e-5, atol=1e-6)

    # A one-device checkpoint resumed on 2 stages x 2 sharded replicas.
    plain_ckpt = tmp_path / "plain.ckpt"
    _reference(tmp_path, "ref1", epochs=1, callbacks=[SaveAtEpochEnd(plain_ckpt)])
    records = _pipeline(
        tmp_path, "zero-resumed", devices=4, epochs=2, ckpt_path=str(plain_ckpt),
        strategy_kwargs=dict(shard_optimizer_state=True),
    )  # fmt: skip
    assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_activation_checkpointing_matches_one_device(tmp_path):
    ref = _reference(tmp_path, "ref", epochs=1)
    records = _pipeline(
        tmp_path, "ac", devices=2, epochs=1, callbacks=[RecordOptimizer()],
        strategy_kwargs=dict(activation_checkpointing=True),
    )  # fmt: skip
    assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(records[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6
    )
    # Every layer of each stage is recomputed (5 layers: 3 + 2 under the uniform split).
    assert [r["extra"]["checkpointed"] for r in records] == [["0", "1", "2"], ["3", "4"]]


class RecordRecomputed(Callback):
    """The traced stages' units this rank wrapped (the stage modules are built at the first step)."""

    def on_train_start(self, trainer, pl_module):
        wrapped = set()

        def spy(stage):  # (after the techniques' own per-stage work, which came first)
            wrapped.update(n for n, m in stage.units if is_checkpointed(m))
            pl_module.recorded = {"wrapped": sorted(wrapped), "sharded": is_sharded(trainer.optimizers[0])}

        trainer.strategy.parts.runner.stages.each_stage(spy)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_traced_gpt_with_recomputed_blocks_and_sharded_state_matches_one_device(tmp_path):
    """The traced path: a GPT with a tied head, 2 stages x 2 replicas, both memory options at once."""
    data = token_data(48)
    torch.manual_seed(0)
    ref = fit(TinyGPT(), reference_loader(data, 8), tmp_path / "ref", devices=1, max_epochs=1,
              gradient_clip_val=0.5)[0]  # fmt: skip
    torch.manual_seed(0)
    strategy = PipelineStrategy(
        pipeline_size=2, num_microbatches=2, start_method=START_METHOD, activation_checkpointing=True,
        shard_optimizer_state=True,
    )  # fmt: skip
    records = fit(
        TinyGPT(), loader(data, 4), tmp_path / "pp", devices=4, strategy=strategy, max_epochs=1,
        gradient_clip_val=0.5, callbacks=[RecordRecomputed()],
    )  # fmt: skip
    assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-6)
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    # True recomputes the blocks each stage calls, not the embeddings or the tied head.
    assert [r["extra"]["wrapped"] for r in records] == [["h.0", "h.1"]] * 2 + [["h.2", "h.3"]] * 2
    assert all(r["extra"]["sharded"] for r in records)


def test_activation_checkpointing_names_are_checked_against_the_whole_sequential():
    trainer = quiet_trainer(
        devices=1, max_steps=1,
        strategy=PipelineStrategy(pipeline_size=1, activation_checkpointing=["layers.1", "layers.9"]),
    )  # fmt: skip
    match = r"do not exist: \['layers.9'\]; the units are \['layers.0', 'layers.1'"
    with pytest.raises(ValueError, match=match):
        trainer.fit(ScheduledAdamW(), loader(regression_data(N_SAMPLES), 8))


def test_activation_checkpointing_names_are_checked_against_the_traced_units():
    strategy = PipelineStrategy(pipeline_size=1, num_microbatches=2, activation_checkpointing=["h.1", "h.9"])
    trainer = quiet_trainer(devices=1, max_steps=1, strategy=strategy)
    units = "'wte', 'wpe', 'h.0', 'h.1', 'h.2', 'h.3', 'ln_f', 'lm_head'"
    match = rf"do not exist: \['h.9'\]; the units are \[{units}\]"
    with pytest.raises(ValueError, match=match):
        trainer.fit(TinyGPT(), loader(token_data(16), 8))


@pytest.mark.parametrize("bad", ["layers.1", 3, [1, 2]])
def test_activation_checkpointing_of_the_wrong_type_fails_at_construction(bad):
    with pytest.raises(TypeError, match="activation_checkpointing must be True/False, a callable"):
        PipelineStrategy(activation_checkpointing=bad)
