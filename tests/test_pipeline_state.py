"""PipelineStrategy beyond training: evaluation, prediction, consolidated checkpoints, resume anywhere.

Covers strategies/pipeline/checkpointing.py and strategies/pipeline/consolidated.py (the consolidated file:
gathered on save, resharded on load) through Trainer.save_checkpoint and ckpt_path.
"""

import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from mp_harness import START_METHOD, assert_close_dicts, fit, quiet_trainer, reference_loader
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import PipelineStrategy

DATA = regression_data(64)
VAL = regression_data(23, seed=1)


def _trainer(devices, strategy, tmp_path, **kw):
    return quiet_trainer(devices=devices, strategy=strategy, default_root_dir=tmp_path, **kw)


def _pipeline(**kw):
    kw.setdefault("pipeline_size", 2)
    return PipelineStrategy(num_microbatches=4, schedule="1f1b", start_method=START_METHOD, **kw)


class WritePredictions(BasePredictionWriter):
    """Rank 0 writes every batch's predictions it receives, in the order it receives them."""

    def __init__(self, path):
        super().__init__(write_interval="batch")
        self.path, self.rows = path, []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dl_idx):
        if trainer.is_global_zero:
            self.rows.append(prediction.detach().cpu())
            torch.save(torch.cat(self.rows), self.path)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_validate_test_predict_and_checkpoint_match_one_device(tmp_path):
    torch.manual_seed(0)
    ref_model = SequentialRegressor(adam=True)
    ref = fit(ref_model, reference_loader(DATA, 16), tmp_path / "ref", devices=1)[0]

    torch.manual_seed(0)
    model = SequentialRegressor(adam=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    records = fit(
        model, loader(DATA, 16), tmp_path / "pp", devices=2, strategy=_pipeline(),
        enable_checkpointing=True, callbacks=[ckpt],
    )  # fmt: skip
    assert_close_dicts({**records[0]["params"], **records[1]["params"]}, ref["params"])

    # One consolidated file by rank 0: the unsplit keys and the whole optimizer state.
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert list(saved["state_dict"]) == list(ref_model.state_dict())
    opt = saved["optimizer_states"][0]
    assert opt["param_groups"][0]["param_names"] == [n for n, _ in ref_model.named_parameters()]
    assert len(opt["state"]) == len(list(ref_model.parameters()))
    plain = SequentialRegressor.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert_close_dicts(dict(plain.state_dict()), ref["params"])

    # Evaluation runs forward-only through the pipeline and logs the single-device value.
    expected = {}
    for stage in ("validate", "test"):
        trainer = _trainer(1, "auto", tmp_path)
        expected[stage] = getattr(trainer, stage)(ref_model, loader(VAL, 5), verbose=False)[0]
        trainer = _trainer(2, _pipeline(), tmp_path)
        got = getattr(trainer, stage)(model, loader(VAL, 5), verbose=False)[0]
        assert got.keys() == expected[stage].keys()
        for key in got:
            torch.testing.assert_close(
                torch.tensor(got[key]), torch.tensor(expected[stage][key]), rtol=1e-5, atol=1e-6
            )

    # Predictions reach rank 0 in dataset order (a writer there sees them all).
    out = tmp_path / "pred.pt"
    trainer = _trainer(2, _pipeline(), tmp_path, callbacks=[WritePredictions(out)])
    trainer.predict(model, loader(VAL, 5), return_predictions=False)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(out), ref_model(VAL.tensors[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("resume_as", ["1 stage x 2 replicas", "single device"])
def test_resume_at_another_shape_continues_exactly(tmp_path, resume_as):
    """Saved at 2 stages x 1 after one epoch, resumed elsewhere: same parameters as uninterrupted."""
    torch.manual_seed(0)
    ref = fit(
        SequentialRegressor(adam=True), reference_loader(DATA, 16), tmp_path / "ref", devices=1, max_epochs=2
    )[0]

    torch.manual_seed(0)
    model = SequentialRegressor(adam=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(
        model, loader(DATA, 16), tmp_path / "first", devices=2, strategy=_pipeline(),
        enable_checkpointing=True, callbacks=[ckpt], max_epochs=1,
    )  # fmt: skip

    torch.manual_seed(123)  # the resumed run must not depend on its own initialisation
    if resume_as == "single device":
        devices, strategy, batch = 1, "auto", reference_loader(DATA, 16)
    else:
        devices, strategy, batch = 2, _pipeline(pipeline_size=1), loader(DATA, 8)
    resumed = quiet_trainer(devices=devices, strategy=strategy, max_epochs=2)
    model = SequentialRegressor(adam=True)
    resumed.fit(model, batch, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert_close_dicts(dict(model.state_dict()), ref["params"])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_resuming_with_a_mismatched_model_or_optimizer_is_a_clear_error(tmp_path):
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(
        SequentialRegressor(adam=True), loader(DATA, 16), tmp_path / "first", devices=2, strategy=_pipeline(),
        enable_checkpointing=True, callbacks=[ckpt], max_epochs=1,
    )  # fmt: skip
    path = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(Exception, match=r"resume with the same optimizer"):
        _trainer(1, _pipeline(pipeline_size=1), tmp_path, max_epochs=2).fit(
            SequentialRegressor(adam=False), loader(DATA, 16), ckpt_path=path
        )
    mismatch = r"does not match SequentialRegressor: missing keys \['layers.3.0.bias'.*unexpected keys"
    with pytest.raises(Exception, match=mismatch + r" \['layers.3.bias'"):
        deeper = SequentialRegressor(adam=True, depth=5)
        _trainer(1, _pipeline(pipeline_size=1), tmp_path, max_epochs=2).fit(
            deeper, loader(DATA, 16), ckpt_path=path
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_predictions_of_several_replicas_arrive_in_dataset_order(tmp_path):
    """2 stages x 2 replicas: the unpadded shards (12 and 11 samples, batches of 5) merge on rank 0."""
    torch.manual_seed(0)
    model = SequentialRegressor()
    out = tmp_path / "pred.pt"
    trainer = _trainer(4, _pipeline(), tmp_path, callbacks=[WritePredictions(out)])
    trainer.predict(model, loader(VAL, 5), return_predictions=False)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(out), model(VAL.tensors[0]), rtol=1e-5, atol=1e-6)
