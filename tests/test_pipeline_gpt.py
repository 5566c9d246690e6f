"""A nanoGPT-shaped module (ModuleList blocks, tied embedding/head, no Sequential) against one device.

The traced path: forward is split with torch.export at the blocks; the tied weight is replicated on the
first and last stage, its gradients summed, and the replicas stay bit-identical.

Covers sources/traced/source.py.
"""

import csv
import glob

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from mp_harness import START_METHOD, assert_close_dicts, fit, merged_params, quiet_trainer, reference_loader
from test_pipeline_state import WritePredictions
from tiny_models import DeviceAwareGPT, NanoGPT, SkipGPT, TinyGPT, loader, masked_token_data, token_data

from lightning_parallel import AllReducedMetrics, GradientAccumulationScheduler, PipelineStrategy

# 44 sequences: the epoch ends on a short batch, which is traced again at its shape.
DATA = token_data(44)
VAL = token_data(13, seed=1)

# gpipe-2x1 runs DeviceAwareGPT: torch.autocast(x.device.type, enabled=False) and a branch on x.device.type
# in every block (the twin is traced on fake CPU tensors, so both take the CPU's path, as the reference).
CASES = {
    "gpipe-2x1": dict(devices=2, pipeline_size=2, schedule="gpipe", model=DeviceAwareGPT),
    "1f1b-2x1": dict(devices=2, pipeline_size=2, schedule="1f1b"),
    "interleaved-2x1x2": dict(devices=2, pipeline_size=2, schedule="interleaved_1f1b", stages_per_rank=2),
    "1f1b-2x2-accumulation": dict(devices=4, pipeline_size=2, schedule="1f1b", accumulate=True),
}


def _logged(run_dir, key):
    rows = []
    for path in glob.glob(f"{run_dir}/**/metrics.csv", recursive=True):
        with open(path) as f:
            rows += [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]
    return [v for _, v in sorted(rows)]


def _assert_trained_as_on_one_device(records, ref):
    """Every rank's stages together hold the one-device weights; the losses are the one-device losses."""
    assert_close_dicts(merged_params(records), ref["params"], rtol=1e-5, atol=1e-6)
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def _tied_replicas(records):
    """The tied weight as held by each rank that holds it (under either of its names)."""
    return [r["params"].get("wte.weight", r["params"].get("lm_head.weight")) for r in records]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_gpt_training_matches_single_device(tmp_path, case):
    cfg = dict(CASES[case])
    devices, accumulate = cfg.pop("devices"), cfg.pop("accumulate", False)
    model_cls = cfg.pop("model", TinyGPT)
    dp = devices // cfg["pipeline_size"]
    global_batch = 16 if accumulate else 8  # accumulation: 2 batches of 8 per step, over the replicas

    def extra(run: str):
        if not accumulate:
            return {}
        callbacks = [GradientAccumulationScheduler(global_batch_size=16), AllReducedMetrics()]
        logger = CSVLogger(tmp_path / run / "logs", name="", version="")
        return dict(callbacks=callbacks, logger=logger, log_every_n_steps=1)

    torch.manual_seed(0)
    ref = fit(
        model_cls(), reference_loader(DATA, 8), tmp_path / "ref", devices=1, max_epochs=2,
        gradient_clip_val=0.5, **extra("ref"),
    )[0]  # fmt: skip
    torch.manual_seed(0)
    model = model_cls()
    strategy = PipelineStrategy(num_microbatches=4, start_method=START_METHOD, **cfg)
    records = fit(
        model, loader(DATA, 8 // dp), tmp_path / "pp", devices=devices, strategy=strategy, max_epochs=2,
        gradient_clip_val=0.5, **extra("pp"),
    )  # fmt: skip
    assert global_batch in (8, 16)

    _assert_trained_as_on_one_device(records, ref)
    # The spawn launcher brings every stage's weights back, tie intact, into the user's module.
    assert_close_dicts(dict(model.state_dict()), ref["params"], rtol=1e-5, atol=1e-6)
    assert model.lm_head.weight is model.wte.weight
    # Every replica of the tied weight took the same updates: bit-identical on every rank.
    replicas = _tied_replicas(records)
    assert len(replicas) == devices and all(torch.equal(t, replicas[0]) for t in replicas)
    if accumulate:  # AllReducedMetrics: what rank 0 logs is the value over every replica
        logged, expected = _logged(tmp_path / "pp", "train_loss"), _logged(tmp_path / "ref", "train_loss")
        assert len(logged) == len(expected) > 0
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_values_read_past_the_next_stage_train_and_validate_as_on_one_device(tmp_path):
    """The litgpt / Hugging Face shape: forward(idx, keep) hands a padding mask (a root input first read
    by h.2) and the embeddings (read by every block) past the next stage; 4 stages on 2 ranks."""
    data, val = masked_token_data(24), masked_token_data(8, seed=1)
    kw = dict(max_epochs=1, gradient_clip_val=0.5)
    torch.manual_seed(0)
    ref = fit(SkipGPT(), reference_loader(data, 8), tmp_path / "ref", devices=1,
              val_dataloaders=loader(val, 4), **kw)[0]  # fmt: skip
    torch.manual_seed(0)
    strategy = PipelineStrategy(
        pipeline_size=2, schedule="interleaved_1f1b", stages_per_rank=2, num_microbatches=4,
        start_method=START_METHOD,
    )  # fmt: skip
    records = fit(SkipGPT(), loader(data, 8), tmp_path / "pp", devices=2, strategy=strategy,
                  val_dataloaders=loader(val, 4), **kw)  # fmt: skip

    _assert_trained_as_on_one_device(records, ref)
    for r in records:
        torch.testing.assert_close(
            r["callback_metrics"]["val_loss"], ref["callback_metrics"]["val_loss"], rtol=1e-5, atol=1e-6
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_nanogpt_forward_with_targets_and_its_loss_inside_trains_as_on_one_device(tmp_path):
    """``logits, loss = self(idx, targets)``: the targets are a root input read by the last stage only,
    and the forward returns a scalar loss beside the logits (nothing to merge across micro-batches)."""
    torch.manual_seed(0)
    ref = fit(NanoGPT(), reference_loader(DATA, 8), tmp_path / "ref", devices=1)[0]
    torch.manual_seed(0)
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=4, start_method=START_METHOD)
    records = fit(NanoGPT(), loader(DATA, 8), tmp_path / "pp", devices=2, strategy=strategy)
    _assert_trained_as_on_one_device(records, ref)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gpt_checkpoint_keeps_the_tie_and_resumes_on_one_device_and_at_another_stage_count(tmp_path):
    kw = dict(max_epochs=1, enable_checkpointing=True)
    torch.manual_seed(0)
    ref_model = TinyGPT()
    ref = fit(ref_model, reference_loader(DATA, 8), tmp_path / "ref", devices=1, **kw)[0]
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    pp = PipelineStrategy(pipeline_size=2, num_microbatches=2, start_method=START_METHOD)
    fit(TinyGPT(), loader(DATA, 8), tmp_path / "pp", devices=2, strategy=pp, callbacks=[ckpt], **kw)

    # One file with the module's own keys, both names of the tied weight; a plain module loads it tied.
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert list(saved["state_dict"]) == list(ref_model.state_dict())
    plain = TinyGPT.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert plain.lm_head.weight is plain.wte.weight
    assert_close_dicts(dict(plain.state_dict()), ref["params"])
    names = saved["optimizer_states"][0]["param_groups"][0]["param_names"]
    assert names == [n for n, _ in ref_model.named_parameters()]  # the tied weight once, in model order

    # A second epoch: on one device (no pipeline), and as 1 stage x 2 replicas; both as if never stopped.
    torch.manual_seed(0)
    ref2 = fit(TinyGPT(), reference_loader(DATA, 8), tmp_path / "ref2", devices=1, max_epochs=2)[0]
    one = fit(TinyGPT(), reference_loader(DATA, 8), tmp_path / "one", devices=1, max_epochs=2,
              ckpt_path=tmp_path / "ckpt" / "last.ckpt")[0]  # fmt: skip
    assert_close_dicts(one["params"], ref2["params"])
    dp = PipelineStrategy(pipeline_size=1, num_microbatches=2, start_method=START_METHOD)
    records = fit(TinyGPT(), loader(DATA, 4), tmp_path / "dp", devices=2, strategy=dp, max_epochs=2,
                  ckpt_path=tmp_path / "ckpt" / "last.ckpt")  # fmt: skip
    assert_close_dicts(records[0]["params"], ref2["params"])
    assert records[0]["params"]["lm_head.weight"].equal(records[1]["params"]["lm_head.weight"])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_gpt_validation_and_predictions_match_one_device(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    expected = quiet_trainer(devices=1).validate(model, loader(VAL, 4), verbose=False)[0]
    with torch.no_grad():
        expected_tokens = model(VAL.tensors[0]).argmax(-1)
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2, start_method=START_METHOD)
    got = quiet_trainer(devices=2, strategy=strategy).validate(model, loader(VAL, 4), verbose=False)[0]
    torch.testing.assert_close(
        torch.tensor(got["val_loss"]), torch.tensor(expected["val_loss"]), rtol=1e-5, atol=1e-6
    )
    out = tmp_path / "pred.pt"
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2, start_method=START_METHOD)
    trainer = quiet_trainer(devices=2, strategy=strategy, callbacks=[WritePredictions(out)])
    trainer.predict(model, loader(VAL, 4), return_predictions=False)
    assert torch.equal(torch.load(out), expected_tokens)
