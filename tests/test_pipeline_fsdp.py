"""PipelineStrategy(data_parallel="fsdp"): FSDP2 inside pipeline stages, against one device.

The multi-process configurations share one spawned job of 4 gloo ranks: each rank runs several
Trainers in turn on the process group the job set up (as under torchrun), so the imports are paid once.

Covers techniques/_fsdp_internals.py (finish_backward, spied on), techniques/fsdp.py's technique
through the stage view (parallelize_fn, then FSDP2, on each stage module; the traced configurations' one
FSDP root per stage, ShardedTracedStage) and techniques/recompute.py's recomputation
(activation_checkpointing=True).
"""

import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from mp_harness import (
    GatheredRecorder,
    SaveAtEpochEnd,
    assert_close_dicts,
    fit,
    merged_records,
    quiet_trainer,
    reference_loader,
    spawn_gloo,
)
from tiny_models import SequentialGPT, SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy
from lightning_parallel.distributed.dtensors import local
from lightning_parallel.memory.resolve import resolve
from lightning_parallel.techniques import fsdp

# 48 samples, global batch 16: 3 batches an epoch; with accumulate_grad_batches=2 the windows are
# [0, 1] and [2] (Lightning steps at the epoch's end): a full and a partial window per epoch.
N_SAMPLES, GLOBAL_BATCH, WORLD = 48, 16, 4
TRAIN = dict(max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2)


class AdamRegressor(SequentialRegressor):
    def __init__(self):
        super().__init__(hidden=32, depth=5, adam=True)


class TiedEnds(SequentialRegressor):
    """The first and the last layer share one weight, on different stages: two FSDP-sharded replicas."""

    def __init__(self):
        super().__init__(d_in=16, hidden=16, d_out=16, adam=True)
        self.layers[-1].weight = self.layers[0][0].weight


TIED_DATA = dict(n=32, d_in=16, d_out=16)


class Record(GatheredRecorder):
    """Also: the parameter bytes this rank holds, and those the stage table says each of its ranks keeps."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self.held_bytes = sum(local(p).untyped_storage().nbytes() for p in pl_module.parameters())
        self.table_bytes = [
            s.bytes_per_rank for s in trainer.strategy.plan.stages if trainer.global_rank in s.ranks
        ]

    def extra(self, trainer, pl_module):
        return {"bytes": (self.held_bytes, self.table_bytes)}


# name -> (strategy kwargs, epochs, expected ends of FSDP's backward on each rank: False = a batch's
# schedule.step() ends without reducing, True = the one reduce-scatter of an optimizer step). Run in
# this order inside the spawned job; the later runs resume the first run's checkpoint for epoch 2.
ONE_EPOCH = [False, False, True, False, True]  # windows [0, 1] and [2]
CONFIGS = {
    "fsdp-2x2": (dict(pipeline_size=2, data_parallel="fsdp"), 2, ONE_EPOCH * 2),
    "hsdp-1x2x2": (dict(pipeline_size=1, data_parallel="fsdp", data_parallel_shard_size=2), 2, ONE_EPOCH),
    "fsdp-2x2-interleaved-recompute": (
        dict(
            pipeline_size=2, data_parallel="fsdp", schedule="interleaved_1f1b", stages_per_rank=2,
            activation_checkpointing=True,
        ),
        2,
        [r for r in ONE_EPOCH for _ in range(2)],  # two stages (two FSDP roots) per rank
    ),
}  # fmt: skip

# A GPT (embeddings, blocks, ln_f, head tied to the token embedding) in one Sequential: one epoch of
# 3 batches of 8 (windows [0, 1] and [2]), each config from the same initial weights. Under HSDP its
# head is untied, with a bias, and the step writes into its output in place (InPlaceLogitsGPT).
GPT_SAMPLES, GPT_BATCH = 24, 8
GPT_TRAIN = dict(max_epochs=1, gradient_clip_val=0.5, accumulate_grad_batches=2)
GPT_CONFIGS = {
    "gpt-fsdp-2x2": (dict(pipeline_size=2, data_parallel="fsdp", num_microbatches=2), ONE_EPOCH),
    "gpt-hsdp-1x2x2-inplace": (
        dict(pipeline_size=1, data_parallel="fsdp", data_parallel_shard_size=2, num_microbatches=2),
        ONE_EPOCH,
    ),
}  # fmt: skip


# The traced path (TinyGPT: ModuleList blocks, head tied to the embedding), one FSDP root per stage: 44
# sequences, so each epoch ends on a short batch traced again (the root then runs another graph), and
# validation runs the forward-only graphs.
TRACED_DATA, TRACED_VAL = token_data(44), token_data(12, seed=1)
TRACED_TRAIN = dict(max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2)
TRACED_CONFIGS = {
    "traced-fsdp-2x2": dict(pipeline_size=2, data_parallel="fsdp", num_microbatches=4),
    "traced-hsdp-1x2x2": dict(
        pipeline_size=1, data_parallel="fsdp", data_parallel_shard_size=2, num_microbatches=2
    ),
}


class InPlaceLogitsGPT(SequentialGPT):
    """A head with a bias (untied): on a 3-D input it returns a view, on which FSDP2 warns that an
    in-place op drops its pre-backward hook (``fsdp.quiet_view_output_warning``); and the step writes
    into that view in place."""

    def __init__(self):
        super().__init__()
        head = self.layers[-1]
        self.layers[-1] = torch.nn.Linear(head.in_features, head.out_features)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        logits.mul_(0.5)
        logits[..., 0] = -5.0
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss


def _gpt(inplace: bool = False) -> SequentialGPT:
    torch.manual_seed(0)
    return InPlaceLogitsGPT() if inplace else SequentialGPT(tied=True)


@contextmanager
def _reductions_recorded(path: str):
    """Record, in order, whether each end of FSDP's backward reduced the gradients (True) or not."""
    calls, original = [], fsdp.finish_backward

    def spy(root, reduce):
        calls.append(reduce)
        original(root, reduce)

    fsdp.finish_backward = spy
    try:
        yield
    finally:
        fsdp.finish_backward = original
        torch.save(calls, path)


def _job(rank: int, world: int, out_dir: str) -> None:
    # The spawned ranks already share a gloo process group: Lightning joins it as it joins torchrun's.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    data, ckpt = regression_data(N_SAMPLES), f"{out_dir}/fsdp.ckpt"
    for name, (kwargs, epochs, _) in CONFIGS.items():
        dp = world // kwargs["pipeline_size"]
        torch.manual_seed(0)
        first = name == "fsdp-2x2"
        callbacks = [Record(f"{out_dir}/{name}-rank{rank}.pt"), *([SaveAtEpochEnd(ckpt)] if first else [])]
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(num_microbatches=4, **kwargs), callbacks=callbacks,
            limit_val_batches=2, **{**TRAIN, "max_epochs": epochs},
        )  # fmt: skip
        with _reductions_recorded(f"{out_dir}/{name}-reductions-rank{rank}.pt"):
            trainer.fit(
                AdamRegressor(), loader(data, GLOBAL_BATCH // dp),
                val_dataloaders=loader(data, GLOBAL_BATCH // dp) if first else None,
                ckpt_path=None if first else ckpt,
            )  # fmt: skip
    gpt_data = token_data(GPT_SAMPLES)
    for name, (kwargs, _) in GPT_CONFIGS.items():
        dp = world // kwargs["pipeline_size"]
        record = Record(f"{out_dir}/{name}-rank{rank}.pt")
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(**kwargs), callbacks=[record], **GPT_TRAIN
        )
        model = _gpt(inplace=name.endswith("-inplace"))
        with (
            _reductions_recorded(f"{out_dir}/{name}-reductions-rank{rank}.pt"),
            warnings.catch_warnings(record=True) as shown,
        ):
            warnings.simplefilter("always")
            trainer.fit(model, loader(gpt_data, GPT_BATCH // dp))
        views = [str(w.message) for w in shown if re.match(fsdp.VIEW_OUTPUT_WARNING, str(w.message))]
        torch.save(views, f"{out_dir}/{name}-view-warnings-rank{rank}.pt")
    for name, kwargs in TRACED_CONFIGS.items():
        dp = world // kwargs["pipeline_size"]
        torch.manual_seed(0)
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(**kwargs),
            callbacks=[GatheredRecorder(f"{out_dir}/{name}-rank{rank}.pt")], **TRACED_TRAIN,
        )  # fmt: skip
        trainer.fit(TinyGPT(), loader(TRACED_DATA, 8 // dp), val_dataloaders=loader(TRACED_VAL, 12 // dp))
    # A weight tied across the stages: its sharded replicas sum their local shards' gradients.
    torch.manual_seed(0)
    trainer = quiet_trainer(
        devices=world, strategy=PipelineStrategy(pipeline_size=2, num_microbatches=2, data_parallel="fsdp"),
        callbacks=[Record(f"{out_dir}/tied-rank{rank}.pt")], gradient_clip_val=0.5,
    )  # fmt: skip
    trainer.fit(TiedEnds(), loader(regression_data(**TIED_DATA), 4))
    torch.save(None, f"{out_dir}/rank{rank}.pt")


def _merged(out_dir: Path, name: str) -> tuple[dict, torch.Tensor, list[dict]]:
    return merged_records(out_dir, name, WORLD)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fsdp_hsdp_and_interleaved_stages_match_one_device_reducing_once_per_step(tmp_path):
    """The Sequential path (an MLP, a tied MLP, a tied GPT) and the traced path (a tied GPT)."""
    torch.manual_seed(0)
    data = regression_data(N_SAMPLES)
    ref = fit(AdamRegressor(), reference_loader(data, GLOBAL_BATCH), tmp_path / "ref", **TRAIN)[0]
    torch.manual_seed(0)
    tied_data = reference_loader(regression_data(**TIED_DATA), 8)
    tied_ref = fit(TiedEnds(), tied_data, tmp_path / "tied-ref", gradient_clip_val=0.5)[0]
    gpt_ref = fit(
        _gpt(), reference_loader(token_data(GPT_SAMPLES), GPT_BATCH), tmp_path / "gpt-ref", **GPT_TRAIN
    )[0]
    gpt_inplace_ref = fit(
        _gpt(inplace=True), reference_loader(token_data(GPT_SAMPLES), GPT_BATCH), tmp_path / "gpt-ip-ref",
        **GPT_TRAIN,
    )[0]  # fmt: skip
    torch.manual_seed(0)
    traced_ref = fit(
        TinyGPT(), reference_loader(TRACED_DATA, 8), tmp_path / "traced-ref",
        val_dataloaders=loader(TRACED_VAL, 12), **TRACED_TRAIN,
    )[0]  # fmt: skip
    spawn_gloo(_job, WORLD, tmp_path)
    for name in TRACED_CONFIGS:
        params, losses, records = _merged(tmp_path, name)
        assert_close_dicts(params, traced_ref["params"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses, torch.tensor(traced_ref["losses"]), rtol=1e-5, atol=1e-6)
        # Every parameter each rank holds is a DTensor over its shards (the tied weight too).
        assert all({held[0] for held in r["held"].values()} == {"DTensor"} for r in records), name
    for name, (_, _, reductions) in CONFIGS.items():
        params, losses, records = _merged(tmp_path, name)
        assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
        expected = torch.tensor(ref["losses"])[-len(losses) :]  # the resumed run: its second epoch
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        # One reduce-scatter per optimizer step, none per batch (nor per micro-batch).
        assert torch.load(tmp_path / f"{name}-reductions-rank0.pt") == reductions, name
    for name, (_, reductions) in GPT_CONFIGS.items():
        params, losses, records = _merged(tmp_path, name)
        # In-place ops on the head's output view (which FSDP2 warns about) leave the result exact: the
        # stages stay gathered for the whole step, and the package ends backward itself.
        ref_run = gpt_inplace_ref if name.endswith("-inplace") else gpt_ref
        assert_close_dicts(params, ref_run["params"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            losses, torch.tensor(ref_run["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
        # ... and FSDP2's warning about that view is filtered where the package shards (every rank).
        for rank in range(WORLD):
            assert torch.load(tmp_path / f"{name}-view-warnings-rank{rank}.pt") == [], (name, rank)
        assert torch.load(tmp_path / f"{name}-reductions-rank0.pt") == reductions, name
        # Every stage parameter of every rank is a DTensor sharded over the stage's data-parallel ranks.
        placement = "(Shard(dim=0),)" if name.startswith("gpt-fsdp-2x2") else "(Replicate(), Shard(dim=0))"
        for r in records:
            assert r["held"] and {(t, p) for t, p, _ in r["held"].values()} == {("DTensor", placement)}, (
                name,
                r["held"],
            )
        assert records[0]["held"]["layers.0.wte.weight"][2] == (7, 8), name  # 13 rows over 2 shards
        # The stage table's "per rank" column is what each rank really holds (FSDP2's padded shards).
        assert all(r["bytes"][0] == sum(r["bytes"][1]) for r in records), [r["bytes"] for r in records]
    params, losses, _ = _merged(tmp_path, "tied")
    assert_close_dicts(params, tied_ref["params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses, torch.tensor(tied_ref["losses"]), rtol=1e-5, atol=1e-6)
    assert torch.equal(params["layers.0.0.weight"], params["layers.3.weight"])
    # 2 stages x 2 shards: each rank holds half of each of its stage's weights, as a DTensor.
    _, _, records = _merged(tmp_path, "fsdp-2x2")
    held = records[0]["held"]["layers.0.0.weight"]
    assert held == ("DTensor", "(Shard(dim=0),)", (16, 8)), held
    # HSDP (one stage): sharded over 2 ranks, replicated twice; it resumed the FSDP run's checkpoint.
    _, _, records = _merged(tmp_path, "hsdp-1x2x2")
    held = records[3]["held"]["layers.4.weight"]
    assert held == ("DTensor", "(Replicate(), Shard(dim=0))", (2, 32)), held


def test_fsdp2_warns_of_a_view_output_as_the_filter_expects_and_the_filter_quiets_it(one_rank):
    """torch 2.13's FSDP2 warns at each forward whose output is a view (nn.Linear on a 3-D input gives
    one); fsdp.VIEW_OUTPUT_WARNING matches that warning, and quiet_view_output_warning() filters it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    head = fully_shard(torch.nn.Linear(4, 3), mesh=init_device_mesh("cpu", (1,)))
    x = torch.randn(2, 5, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        head(x)
        fsdp.quiet_view_output_warning()
        head(x)
    views = [str(w.message) for w in shown if re.match(fsdp.VIEW_OUTPUT_WARNING, str(w.message))]
    assert len(views) == 1, [str(w.message) for w in shown]  # the first forward's only
    assert "FSDPLinear" in views[0]


def test_data_parallel_options_are_checked():
    with pytest.raises(ValueError, match=r"unknown data_parallel='zero3': use one of 'replicate', 'zero1'"):
        PipelineStrategy(data_parallel="zero3")
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=2 shards stages with FSDP2, but"):
        PipelineStrategy(data_parallel_shard_size=2)
    with pytest.raises(ValueError, match="pass only one of them"):
        PipelineStrategy(shard_optimizer_state=True, data_parallel="fsdp")
    with pytest.raises(TypeError, match="parallelize_fn must be a callable"):
        PipelineStrategy(parallelize_fn="fsdp")
    planned = resolve(PipelineStrategy(pipeline_size=2, data_parallel="fsdp"), devices=4, precision="32-true")
    assert planned.label() == "pp 2x2 1f1b m=4 +fsdp"  # the memory planner models it
    assert PipelineStrategy(shard_optimizer_state=True).parallel_plan.data_parallel == "zero1"
    assert PipelineStrategy(data_parallel="zero1").parallel_plan.shard_optimizer_state


def test_the_traced_path_refuses_what_its_stages_cannot_take_with_the_reason():
    cases = [
        (dict(parallelize_fn=lambda stage, mesh: None), r"parallelize_fn needs the stage modules of a split"),
        (
            dict(pipeline_size=1, stages_per_rank=2, schedule="interleaved_1f1b", data_parallel="fsdp"),
            r'data_parallel="fsdp" with stages_per_rank=2 is not supported for a traced forward',
        ),
    ]
    for kwargs, message in cases:
        trainer = quiet_trainer(
            devices=1, max_steps=1, strategy=PipelineStrategy(**{"pipeline_size": 1, **kwargs})
        )
        with pytest.raises(ValueError, match=message):
            trainer.fit(TinyGPT(), loader(token_data(8), 4))


class SeesTheMesh(AdamRegressor):
    def configure_model(self):
        mesh = self.trainer.strategy.device_mesh
        self.seen = {"dims": mesh.mesh_dim_names, "shape": tuple(mesh.shape)}


def test_parallelize_fn_gets_each_stage_and_the_mesh_seen_in_configure_model(tmp_path):
    calls = []
    strategy = PipelineStrategy(
        pipeline_size=1, parallelize_fn=lambda stage, mesh: calls.append((type(stage).__name__, mesh.shape))
    )
    model = SeesTheMesh()
    quiet_trainer(devices=1, max_steps=1, strategy=strategy, default_root_dir=tmp_path).fit(
        model, loader(regression_data(16), 8)
    )
    assert model.seen == {"dims": ("pp", "dp_replicate", "dp_shard", "tp"), "shape": (1, 1, 1, 1)}
    assert calls == [("StageModule", (1, 1, 1, 1))]
    gradients = strategy.mesh.device_mesh_of("gradients")  # the replicate x shard ranks, flattened
    assert gradients.size() == 1 and gradients.mesh_dim_names == ("dp",)
    assert strategy.mesh.group("gradients") is not None
