"""PipelineStrategy under 16-mixed (GradScaler), bf16-true and 16-true against one device.

Every run trains 2 stages x 2 replicas on 4 ranks. One spawned job of 4 gloo ranks runs them all one after
the other (each rank starts a Trainer per run, as under torchrun), so the imports are paid once; before
them it runs grads/loss_scale.py's agreement alone, without Lightning (from tests/test_loss_scale.py).
The 16-mixed run saves a distributed checkpoint after its scale changed; two more runs resume from it
and from its consolidated file.

Covers techniques/recompute/technique.py's ZeRO-1 optimizers (shard_optimizer_state=True).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import MixedPrecision
from mp_harness import (
    RankRecorder,
    SaveAtEpochEnd,
    assert_close_dicts,
    fit,
    load_rank_results,
    merged_params,
    quiet_trainer,
    reference_loader,
    spawn_gloo,
)
from test_loss_scale import agreement_outcome, check_agreement
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy, consolidate_checkpoint
from lightning_parallel.strategies.pipeline.precision import install_loss_scaling, scaled_loss

WORLD, PIPELINE_SIZE = 4, 2
REPLICAS = WORLD // PIPELINE_SIZE


class _Fp16Checks:
    """Injects inf into one gradient on one rank at one step; records the loss scale after every batch."""

    inject: tuple[str, int, int] | None = None  # (parameter, optimizer step, replica)

    def on_train_start(self) -> None:
        self.recorded, self._injected = [], False

    def on_after_backward(self) -> None:
        if self.inject is None or self._injected:
            return
        name, step, replica = self.inject
        grad = getattr(dict(self.named_parameters()).get(name), "grad", None)
        mesh = getattr(self.trainer.strategy, "mesh", None)  # one device: no mesh, one replica
        on_this_replica = mesh is None or mesh.rank("data") == replica
        if grad is not None and self.trainer.global_step == step and on_this_replica:
            grad.view(-1)[0] = float("inf")  # on this rank only: the others must skip the step too
            self._injected = True

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.recorded.append(scaler.get_scale() if scaler is not None else None)


class Regressor(_Fp16Checks, SequentialRegressor):
    pass


class SgdGPT(_Fp16Checks, TinyGPT):
    def configure_optimizers(self):
        # SGD, not AdamW: Adam's first steps move every weight by +-lr whatever its gradient's size, so
        # fp16 rounding of a near-zero gradient could flip a sign; SGD's error stays proportional.
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fp16(init_scale: float = 2.0**6, **scaler_kwargs) -> dict:
    # A small initial scale that doubles every 2 clean steps: no natural overflow in these tiny models
    # (one that only a micro-batch or only the full batch hits would be a spurious difference), and
    # both growth and back-off happen within 8 steps.
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2, **scaler_kwargs)
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler)])


# name -> (model class, data, global batch, inf injected at (parameter, step, replica), Trainer arguments)
RUNS = {
    # The Sequential path, accumulation and clipping; inf in stage 0 of replica 1 only, at step 5 (in the
    # second epoch: the checkpoint saved at the end of the first holds a scale that grew, 2**8).
    "sequential-16-mixed": (
        Regressor, regression_data(64), 8, ("layers.0.0.weight", 5, 1),
        dict(gradient_clip_val=0.5, accumulate_grad_batches=2, max_epochs=2, precision_fn=_fp16),
    ),
    # The same with ZeRO-1 (each replica steps its shard of the stage, then broadcasts it): the sharded
    # step and its broadcasts are skipped on every rank alike. Inf in stage 1 of replica 0.
    "sequential-16-mixed-zero": (
        Regressor, regression_data(64), 8, ("layers.3.weight", 3, 0),
        dict(gradient_clip_val=0.5, accumulate_grad_batches=2, max_epochs=2, precision_fn=_fp16,
             shard_optimizer_state=True),
    ),
    # The traced path with the tied head (replicas on both stages); inf in stage 1 of replica 0, step 2.
    "gpt-16-mixed": (
        SgdGPT, token_data(32), 8, ("h.3.mlp.2.weight", 2, 0),
        dict(gradient_clip_val=0.5, max_epochs=2, precision_fn=_fp16),
    ),
    "sequential-bf16-true": (Regressor, regression_data(32), 8, None, dict(precision="bf16-true")),
    "sequential-16-true": (Regressor, regression_data(32), 8, None, dict(precision="16-true")),
}  # fmt: skip


SAVES_AT_EPOCH_END = "sequential-16-mixed"  # a distributed checkpoint, after the scale changed
RESUMES = {"resumed-from-directory": "epoch0.ckpt", "resumed-from-file": "epoch0-whole.ckpt"}


def _train(
    name: str, out_dir: str | os.PathLike, devices: int, resume: str | None = None, init_scale: float = 2.0**6
) -> None:
    model_cls, data, global_batch, inject, kwargs = RUNS[name]
    kwargs = dict(kwargs)
    precision_fn, zero = kwargs.pop("precision_fn", None), kwargs.pop("shard_optimizer_state", False)
    kwargs.update(precision_fn(init_scale) if precision_fn else {})
    torch.manual_seed(0)
    model = model_cls()
    model.inject = inject
    if devices == 1:
        fit(model, reference_loader(data, global_batch), out_dir, **kwargs)
        return
    directories = name == SAVES_AT_EPOCH_END and (resume is None or resume.endswith("epoch0.ckpt"))
    callbacks = [RankRecorder(out_dir)]
    if name == SAVES_AT_EPOCH_END and resume is None:
        callbacks.append(SaveAtEpochEnd(Path(out_dir).parent / "epoch0.ckpt"))
    strategy = PipelineStrategy(
        pipeline_size=PIPELINE_SIZE, num_microbatches=2, shard_optimizer_state=zero,
        save_distributed_checkpoint=directories,
    )  # fmt: skip
    # Not fit(): it reads every rank's record back, which another rank may still be writing.
    trainer = quiet_trainer(devices=devices, strategy=strategy, callbacks=callbacks, **kwargs)
    trainer.fit(model, loader(data, global_batch // REPLICAS), ckpt_path=resume)


def _job(rank: int, world: int, out_dir: str) -> None:
    # Each rank starts its own Trainers, as torchrun's workers do: Lightning finds LOCAL_RANK, creates no
    # processes, and uses the process group that is already there.
    torch.save(agreement_outcome(rank), Path(out_dir) / f"agreement-rank{rank}.pt")  # no Lightning
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for name in RUNS:
        _train(name, Path(out_dir) / name, world)
    if rank == 0:
        consolidate_checkpoint(Path(out_dir) / "epoch0.ckpt", Path(out_dir) / "epoch0-whole.ckpt")
    dist.barrier()
    for name, checkpoint in RESUMES.items():  # a fresh scaler with another scale: the saved one must win
        _train(SAVES_AT_EPOCH_END, Path(out_dir) / name, world, str(Path(out_dir) / checkpoint), 2.0**12)
    torch.save({}, Path(out_dir) / f"rank{rank}.pt")


def test_the_loss_is_scaled_under_16_mixed_only_and_fused_optimizers_are_refused():
    loss = torch.tensor(3.0)
    fp16 = _fp16()["plugins"][0]
    assert scaled_loss(fp16, loss).item() == 3.0 * 2**6
    assert scaled_loss(MixedPrecision("bf16-mixed", "cpu"), loss) is loss
    disabled = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", enabled=False))
    assert scaled_loss(disabled, loss) is loss
    weight = torch.nn.Parameter(torch.ones(2))
    install_loss_scaling(fp16, [torch.optim.AdamW([weight], foreach=True)])
    with pytest.raises(ValueError, match=r"AdamW unscales inside its own step \(fused=True\).*fused=False"):
        install_loss_scaling(fp16, [torch.optim.AdamW([weight], fused=True)])


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pp")
    spawn_gloo(_job, WORLD, out)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_rank_overflowing_makes_every_rank_skip_and_back_off_without_lightning(pipelined):
    """grads/loss_scale.py alone, on the job's 4 gloo ranks (see tests/test_loss_scale.py)."""
    check_agreement([torch.load(pipelined / f"agreement-rank{r}.pt") for r in range(WORLD)])


def _reference(name: str, tmp_path: Path) -> dict:
    _train(name, tmp_path / name, 1)
    return load_rank_results(tmp_path / name)[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sequential-16-mixed", "sequential-16-mixed-zero", "gpt-16-mixed"])
def test_16_mixed_trains_as_on_one_device_and_every_rank_skips_an_overflow(pipelined, tmp_path, name):
    ref, records = _reference(name, tmp_path), load_rank_results(pipelined / name)
    scales = ref["extra"]
    # The reference itself: the scale grew, and halved at the injected step (which it skipped).
    assert max(scales) > scales[0] and any(b == a / 2 for a, b in itertools.pairwise(scales)), scales
    # Every rank, whichever stage or replica, skipped that step and holds the one-device scale.
    for r in records:
        assert r["extra"] == scales, f"rank {r['rank']}: {r['extra']} != {scales}"
    # fp16 tolerance. fp16 has an 11-bit significand (unit roundoff 2**-11 = 4.9e-4). The pipeline rounds
    # each micro-batch's fp16 products apart where one device rounds the batch's once (the loss weights
    # 1/2 and the loss scale are powers of two: exact), so a gradient differs by a few roundoffs of its
    # size. Losses (about 1-3) are fp16 values: 2e-3 relative is 4 roundoffs, i.e. one fp16 ulp
    # (measured: up to 4.8e-4). Weights move by lr x gradient, so 8 SGD steps carry the gradients'
    # few-roundoff differences as ~1e-5 absolute (measured 1.2e-5): atol 1e-4. Without the agreement
    # the stages that did not overflow step while the others skip: weights 2.5e-2 apart, scales apart.
    assert_close_dicts(merged_params(records), ref["params"], rtol=2e-3, atol=1e-4)
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=2e-3, atol=1e-4)
    if name.startswith("gpt"):  # the tied weight's replicas took the same updates, bit for bit
        tied = [r["params"].get("wte.weight", r["params"].get("lm_head.weight")) for r in records]
        assert len(tied) == WORLD and all(torch.equal(t, tied[0]) for t in tied)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("resumed", list(RESUMES))
def test_16_mixed_resumed_after_its_scale_changed_goes_on_as_the_uninterrupted_run(pipelined, resumed):
    whole, part = load_rank_results(pipelined / SAVES_AT_EPOCH_END), load_rank_results(pipelined / resumed)
    saved = torch.load(pipelined / "epoch0-whole.ckpt", weights_only=False)["MixedPrecision"]
    assert saved["scale"] != 2.0**6, "the scale did not change before the save: nothing to check"
    for w, r in zip(whole, part):  # the scale after every batch of epoch 1, on every rank
        assert r["extra"] == w["extra"][-len(r["extra"]) :], f"rank {r['rank']}: {r['extra']} != {w['extra']}"
    assert_close_dicts(merged_params(part), merged_params(whole), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sequential-bf16-true", "sequential-16-true"])
def test_true_half_precision_trains_as_on_one_device(pipelined, tmp_path, name):
    ref, records = _reference(name, tmp_path), load_rank_results(pipelined / name)
    dtype = torch.bfloat16 if "bf16" in name else torch.float16
    assert all(t.dtype == dtype for r in records for t in r["params"].values())
    # Weights, gradients and losses are half precision themselves: the pipeline adds its micro-batches'
    # gradients in bf16 (8-bit significand, roundoff 2**-8 = 3.9e-3) or fp16 (4.9e-4) where one device
    # rounds the batch's once. Tolerance: a few roundoffs relative (1e-2: 2.6 bf16 roundoffs; 2e-3: 4 fp16
    # ones), about one ulp of a loss near 3. Measured: losses one ulp apart (1.6e-2 bf16, 2.0e-3 fp16),
    # weights within 2.0e-3 (bf16) and 2.4e-4 (fp16).
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert_close_dicts(merged_params(records), ref["params"], rtol=tol, atol=tol)
    losses = torch.tensor([r["losses"] for r in records]).float().mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]).float(), rtol=tol, atol=tol)
