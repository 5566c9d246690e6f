"""PipelineStrategy(save_distributed_checkpoint=True): DCP directories resumed at other shapes, vs one device.

The multi-process configurations share one spawned job of 4 gloo ranks (several Trainers in turn):
replicas, FSDP2 and HSDP (2 replicas x 2 shards) saved, synchronously and in the background
(``Rank0Checkpoint(async_save=True)``), then resumed at other (pipeline, replicate, shard) shapes.

Covers strategies/pipeline/distributed_checkpoint.py and its hooks in strategies/pipeline/checkpointing.py.
"""

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from mp_harness import assert_close_dicts, fit, quiet_trainer, reference_loader, spawn_gloo
from tiny_models import SequentialRegressor, loader, regression_data
from torch.distributed.checkpoint import FileSystemReader

from lightning_parallel import CheckpointWriteError, PipelineStrategy, Rank0Checkpoint, consolidate_checkpoint
from lightning_parallel.checkpoint import directory
from lightning_parallel.distributed.dtensors import full_tensors

N_SAMPLES, GLOBAL_BATCH, WORLD = 48, 16, 4
TRAIN = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)  # 2 optimizer steps an epoch


class AdamRegressor(SequentialRegressor):
    def __init__(self):
        super().__init__(hidden=32, depth=5, adam=True)


class Record(Callback):
    """Per rank: the losses, the full parameters, and the state-dict keys this rank holds."""

    def __init__(self, path: str) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_fit_end(self, trainer, pl_module):
        held = {k: type(v).__name__ for k, v in pl_module.state_dict().items()}
        params = {k: v.detach().cpu() for k, v in full_tensors(pl_module.state_dict()).items()}
        torch.save({"losses": self.losses, "params": params, "held": held}, self.path)


def _strategy(pipeline_size, data_parallel, shards=None):
    return PipelineStrategy(
        pipeline_size=pipeline_size,
        num_microbatches=2,
        data_parallel=data_parallel,
        data_parallel_shard_size=shards,
        save_distributed_checkpoint=True,
    )


# name -> (pipeline size, data_parallel, shards, epochs, resumed from). The savers run epoch 1 and save at
# its end; "hsdp" (and "replicate"'s top-k one, every step) in the background (async_save=True).
RUNS = {
    "replicate-2x2": (2, "replicate", None, 1, None),
    "fsdp-2x2": (2, "fsdp", None, 1, None),
    "hsdp-1x2x2": (1, "fsdp", 2, 1, None),  # 1 stage, 2 replicas x 2 shards
    "pp4-from-hsdp": (4, "replicate", None, 2, "hsdp"),
    "fsdp4-from-replicate": (1, "fsdp", None, 2, "replicate"),
    "zero1-2x2-from-replicate": (2, "zero1", None, 2, "replicate"),
}


def _savers(name: str, out_dir: str) -> list[Callback]:
    if name == "replicate-2x2":  # Rank0Checkpoint publishes the directory; a second one keeps the newest
        return [
            Rank0Checkpoint(dirpath=f"{out_dir}/r0", filename="rep", every_n_epochs=1, save_top_k=-1),
            Rank0Checkpoint(dirpath=f"{out_dir}/topk", every_n_train_steps=1, save_top_k=1, async_save=True),
        ]
    if name == "fsdp-2x2":  # Lightning's own ModelCheckpoint writes through the strategy
        return [ModelCheckpoint(dirpath=f"{out_dir}/mc", filename="fsdp", every_n_epochs=1)]
    if name == "hsdp-1x2x2":  # DTensor shards on a 2-D mesh, staged and written in the background
        return [Rank0Checkpoint(dirpath=f"{out_dir}/hs", filename="hsdp", every_n_epochs=1, async_save=True)]
    return []


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    data = regression_data(N_SAMPLES)
    saved = {"replicate": f"{out_dir}/r0/rep.ckpt", "fsdp": f"{out_dir}/mc/fsdp.ckpt"}
    saved["hsdp"] = f"{out_dir}/hs/hsdp.ckpt"
    for name, (pp, mode, shards, epochs, source) in RUNS.items():
        callbacks = [Record(f"{out_dir}/{name}-rank{rank}.pt"), *_savers(name, out_dir)]
        torch.manual_seed(0)
        trainer = quiet_trainer(
            devices=world, strategy=_strategy(pp, mode, shards), callbacks=callbacks, max_epochs=epochs,
            enable_checkpointing=len(callbacks) > 1, **TRAIN,
        )  # fmt: skip
        trainer.fit(AdamRegressor(), loader(data, GLOBAL_BATCH // (world // pp)), ckpt_path=saved.get(source))
        if name.startswith("zero1"):
            trainer.save_checkpoint(f"{out_dir}/zero1-end.ckpt")  # each replica writes its ZeRO shard
    # A failure after the shards are written, before the publish: an error on every rank, no directory.
    original = directory.hash_files

    def failing(path, names):
        if rank == 1:
            raise OSError("simulated failure after writing the shards")
        return original(path, names)

    directory.hash_files = failing
    trainer = quiet_trainer(
        devices=world, strategy=_strategy(2, "replicate"), max_steps=1, enable_checkpointing=True,
        callbacks=[Rank0Checkpoint(dirpath=f"{out_dir}/failed", every_n_train_steps=1)],
    )  # fmt: skip
    try:
        trainer.fit(AdamRegressor(), loader(data, GLOBAL_BATCH // 2))
        failure = None
    except CheckpointWriteError as err:
        failure = str(err)
    finally:
        directory.hash_files = original
    torch.save(failure, f"{out_dir}/rank{rank}.pt")


def _merged(out_dir: Path, name: str):
    records = [torch.load(out_dir / f"{name}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    params = {k: v for r in records for k, v in r["params"].items()}
    return params, torch.tensor([r["losses"] for r in records]).mean(0), records


def _files_by_key(path: Path) -> dict[str, set[str]]:
    """Each saved key -> the shard files holding its chunks."""
    out: dict[str, set[str]] = {}
    for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items():
        out.setdefault(index.fqn, set()).add(info.relative_path)
    return out


def _check_each_rank_wrote_its_own(path: Path, records: list[dict], sharded: bool) -> None:
    by_key = _files_by_key(path)
    assert {f for files in by_key.values() for f in files} == {f"__{r}_0.distcp" for r in range(WORLD)}
    for key, files in by_key.items():
        if not key.startswith("state_dict."):
            continue
        name = key[len("state_dict.") :]
        holders = {f"__{r}_0.distcp" for r, rec in enumerate(records) if name in rec["held"]}
        assert files <= holders, (key, files, holders)  # written by the ranks of its stage, nobody else
        if sharded and name.endswith("weight"):
            assert len(files) == 2, (key, files)  # one shard from each of the stage's two ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_distributed_checkpoints_resume_at_other_shapes_exactly(tmp_path):
    torch.manual_seed(0)
    data = regression_data(N_SAMPLES)
    ref = fit(AdamRegressor(), reference_loader(data, GLOBAL_BATCH), tmp_path / "ref", max_epochs=2, **TRAIN)[
        0
    ]
    failures = spawn_gloo(_job, WORLD, tmp_path)
    for name, (_, _, _, epochs, _) in RUNS.items():
        params, losses, _ = _merged(tmp_path, name)
        if epochs == 2:  # a resumed run: its second epoch, and the final parameters, as one device's
            assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                losses, torch.tensor(ref["losses"])[-len(losses) :], rtol=1e-5, atol=1e-6
            )
    # Each rank wrote its own stage's shards; FSDP weights in two shards each; nobody gathered the model.
    _check_each_rank_wrote_its_own(
        tmp_path / "mc" / "fsdp.ckpt", _merged(tmp_path, "fsdp-2x2")[2], sharded=True
    )
    assert _merged(tmp_path, "fsdp-2x2")[2][0]["held"]["layers.0.0.weight"] == "DTensor"
    _check_each_rank_wrote_its_own(tmp_path / "r0" / "rep.ckpt", _merged(tmp_path, "replicate-2x2")[2], False)
    assert directory.verify_checkpoint_dir(str(tmp_path / "r0" / "rep.ckpt")).ok
    # Top-k over directories: the older one was removed, nothing temporary is left.
    assert sorted(os.listdir(tmp_path / "topk")) == ["epoch=0-step=2.ckpt"]
    # The failed save: every rank raised, and neither the directory nor its temporary one exists.
    assert all(f is not None and "simulated failure" in f for f in failures), failures
    assert os.listdir(tmp_path / "failed") == []
    # HSDP: each weight in two shards (the replicas write the same ones once), consolidated exactly.
    hsdp = _merged(tmp_path, "hsdp-1x2x2")
    assert hsdp[2][0]["held"]["layers.0.0.weight"] == "DTensor"
    assert len(_files_by_key(tmp_path / "hs" / "hsdp.ckpt")["state_dict.layers.0.0.weight"]) == 2
    whole = consolidate_checkpoint(tmp_path / "hs" / "hsdp.ckpt", tmp_path / "hsdp-full.ckpt")
    whole = torch.load(whole, weights_only=False)
    assert_close_dicts(whole["state_dict"], hsdp[0], rtol=0, atol=0)
    # One device: the consolidated file loads, and resumes exactly like the uninterrupted run.
    out = consolidate_checkpoint(tmp_path / "mc" / "fsdp.ckpt", tmp_path / "fsdp-full.ckpt")
    assert set(AdamRegressor.load_from_checkpoint(out).state_dict()) == set(ref["params"])
    torch.manual_seed(0)
    one = fit(
        AdamRegressor(),
        reference_loader(data, GLOBAL_BATCH),
        tmp_path / "one",
        max_epochs=2,
        ckpt_path=out,
        **TRAIN,
    )[0]
    assert_close_dicts(one["params"], ref["params"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(one["losses"]), torch.tensor(ref["losses"])[-len(one["losses"]) :]
    )
    # ZeRO-1 saved each replica's optimizer shard; consolidated, the state is whole.
    full = torch.load(
        consolidate_checkpoint(tmp_path / "zero1-end.ckpt", tmp_path / "zero1.ckpt"), weights_only=False
    )
    assert_close_dicts(full["state_dict"], ref["params"], rtol=1e-5, atol=1e-6)
    assert len(full["optimizer_states"][0]["state"]) == len(ref["params"])


def test_save_distributed_checkpoint_must_be_a_bool():
    with pytest.raises(TypeError, match=r"save_distributed_checkpoint must be True .* got 'yes'"):
        PipelineStrategy(save_distributed_checkpoint="yes")
    with pytest.raises(TypeError, match="save_distributed_checkpoints"):
        PipelineStrategy(save_distributed_checkpoints=True)


def test_a_directory_that_is_not_a_distributed_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a distributed checkpoint directory"):
        PipelineStrategy().load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is not a distributed checkpoint directory"):
        consolidate_checkpoint(tmp_path, tmp_path / "out.ckpt")


def test_consolidate_a_one_device_distributed_checkpoint(tmp_path):
    torch.manual_seed(0)
    data = regression_data(N_SAMPLES)
    trainer = quiet_trainer(devices=1, max_steps=2, strategy=_strategy(1, "replicate"))
    model = AdamRegressor()
    trainer.fit(model, loader(data, GLOBAL_BATCH))
    trainer.save_checkpoint(tmp_path / "dcp.ckpt")
    assert directory.verify_checkpoint_dir(str(tmp_path / "dcp.ckpt")).ok
    full = torch.load(
        consolidate_checkpoint(tmp_path / "dcp.ckpt", tmp_path / "one.ckpt"), weights_only=False
    )
    assert_close_dicts(full["state_dict"], model.state_dict(), rtol=0, atol=0)
    # The optimizer state in torch's single-device layout: a plain AdamW loads it and holds the same moments.
    optimizer = trainer.optimizers[0]
    plain = torch.optim.AdamW(AdamRegressor().parameters())
    plain.load_state_dict(full["optimizer_states"][0])
    for p, q in zip(model.parameters(), plain.param_groups[0]["params"]):
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], plain.state[q]["exp_avg"], rtol=0, atol=0)
    assert "main" in dir(__import__("lightning_parallel.checkpoint.consolidate", fromlist=["main"]))
