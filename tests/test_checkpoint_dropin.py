"""Rank0Checkpoint in place of ModelCheckpoint: shared state, save_last="link", strategies, resume warning."""

import inspect
import os
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from test_checkpoint import IdModel, _epoch0_order, _fit, _loader
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import CheckpointWriteError, Rank0Checkpoint
from lightning_parallel.callbacks._checkpoint_strategies import sharded_strategy_problem
from lightning_parallel.io import atomic

# The score logged at the batch that makes optimizer step k+1 (files are named after that step).
SCORES = [3.0, 1.0, 4.0, 2.0, 5.0]
TOP_K = dict(monitor="score", mode="min", save_top_k=2, every_n_train_steps=1, save_last=True)


class ScoreModel(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        self.log("score", SCORES[self.global_step])
        return super().training_step(batch, batch_idx)


def _trainer(ckpt, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt],
        **kwargs,
    )


def test_the_state_key_is_model_checkpoints():
    kwargs = dict(monitor="val_loss", mode="max", every_n_train_steps=3)
    assert Rank0Checkpoint(**kwargs).state_key == ModelCheckpoint(**kwargs).state_key

    class Mine(Rank0Checkpoint):
        pass

    assert Mine(**kwargs).state_key == ModelCheckpoint(**kwargs).state_key


@pytest.mark.parametrize(
    ("first", "second"), [(ModelCheckpoint, Rank0Checkpoint), (Rank0Checkpoint, ModelCheckpoint)]
)
def test_a_run_resumes_with_the_other_callback_and_keeps_its_top_k(tmp_path, first, second):
    dirpath = str(tmp_path / "ckpt")
    data = loader(regression_data(48), 4)
    before = first(dirpath=dirpath, **TOP_K)
    _trainer(before, max_steps=3).fit(ScoreModel(), data)
    assert before.kth_value == 3.0 and before.best_model_path.endswith("step=2.ckpt")

    after = second(dirpath=dirpath, **TOP_K)
    _trainer(after, max_steps=5).fit(ScoreModel(), data, ckpt_path=os.path.join(dirpath, "last.ckpt"))
    # Step 4 (score 2.0) beats the restored kth value (3.0, step 1) and evicts it; step 5 (5.0) does
    # not enter. Started over, the top-k would hold steps 4 and 5 and lose track of step 2.
    names = {os.path.basename(p): float(v) for p, v in after.best_k_models.items()}
    assert names == {"epoch=0-step=2.ckpt": 1.0, "epoch=0-step=4.ckpt": 2.0}
    assert after.best_model_path.endswith("step=2.ckpt") and float(after.best_model_score) == 1.0
    assert float(after.kth_value) == 2.0
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]


def test_both_callbacks_with_the_same_key_are_refused_when_the_trainer_is_built():
    with pytest.raises(RuntimeError, match=r"more than one stateful callback.*state_key. must be unique"):
        L.Trainer(callbacks=[ModelCheckpoint(monitor="score"), Rank0Checkpoint(monitor="score")])
    # With other arguments the keys differ: both keep their own state, as two ModelCheckpoints do.
    trainer = L.Trainer(callbacks=[ModelCheckpoint(monitor="score"), Rank0Checkpoint(monitor="loss")])
    assert len({cb.state_key for cb in trainer.checkpoint_callbacks}) == 2


@pytest.mark.parametrize("async_save", [False, True])
def test_save_last_link_points_at_the_newest_file(tmp_path, async_save):
    dirpath = tmp_path / "ckpt"
    ckpt = Rank0Checkpoint(
        dirpath=str(dirpath), every_n_train_steps=2, save_top_k=-1, save_last="link", async_save=async_save
    )
    trainer = _trainer(ckpt, max_steps=4)
    trainer.fit(SequentialRegressor(), loader(regression_data(48), 4))
    last = dirpath / "last.ckpt"
    assert os.readlink(last) == "epoch=0-step=4.ckpt"
    assert atomic.verify_checkpoint(str(last)).ok and torch.load(last, weights_only=False)["global_step"] == 4
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]

    # Lightning's static signature, on the class and on an instance: (trainer, filepath, linkpath).
    for owner in (Rank0Checkpoint, ckpt):
        assert list(inspect.signature(owner._link_checkpoint).parameters) == [
            "trainer",
            "filepath",
            "linkpath",
        ]
    Rank0Checkpoint._link_checkpoint(trainer, str(dirpath / "epoch=0-step=2.ckpt"), str(last))
    assert os.readlink(last) == "epoch=0-step=2.ckpt"


def test_strategies_that_keep_the_state_sharded_are_detected():
    fsdp = sharded_strategy_problem(FSDPStrategy(state_dict_type="sharded"))
    assert "FSDPStrategy(state_dict_type='sharded')" in fsdp and "state_dict_type='full'" in fsdp
    assert "ModelCheckpoint" in fsdp
    # DeepSpeedStrategy cannot be built without deepspeed installed; the check only looks at the type.
    deepspeed = sharded_strategy_problem(DeepSpeedStrategy.__new__(DeepSpeedStrategy))
    assert "DeepSpeedStrategy" in deepspeed and "ModelCheckpoint" in deepspeed
    assert "save_distributed_checkpoint=False" in sharded_strategy_problem(ModelParallelStrategy())
    for full in (FSDPStrategy(), ModelParallelStrategy(save_distributed_checkpoint=False), DDPStrategy()):
        assert sharded_strategy_problem(full) is None, type(full).__name__


def test_a_sharded_strategy_is_refused_at_setup(tmp_path):
    # FSDPStrategy needs a GPU; ModelParallelStrategy runs on CPU with one device.
    ckpt = Rank0Checkpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)
    trainer = _trainer(ckpt, max_steps=1, strategy=ModelParallelStrategy())
    with pytest.raises(ValueError, match=r"one file from global rank 0, but ModelParallelStrategy\(save_dis"):
        trainer.fit(SequentialRegressor(), loader(regression_data(16), 4))
    assert not (tmp_path / "ckpt").exists()


class ShardedStateModel(SequentialRegressor):
    """Puts a DTensor (a rank's shard) into its checkpoint, as a sharded strategy unknown to us would."""

    def on_save_checkpoint(self, checkpoint):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        checkpoint["sharded"] = {"w": distribute_tensor(torch.ones(4), mesh, [Shard(0)])}


def test_a_sharded_tensor_in_the_state_is_refused_at_save(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dirpath = tmp_path / "ckpt"
    ckpt = Rank0Checkpoint(dirpath=str(dirpath), every_n_train_steps=1)
    with pytest.raises(CheckpointWriteError, match=r"holds a DTensor at 'sharded/w'.*partial checkpoint"):
        _trainer(ckpt, max_steps=1).fit(ShardedStateModel(), loader(regression_data(16), 4))
    assert not dirpath.exists()  # nothing written: no directory either


def _not_resumable_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "not resumable" in str(w.message)]


def test_an_exact_resume_does_not_get_lightnings_not_resumable_warning(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    ckpt = Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)
    _fit(tmp_path / "a", 1, ckpt, max_steps=2)
    model, data = IdModel(), _loader()
    trainer = _trainer(Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True), max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path="last")
    assert _not_resumable_warnings(caught) == []
    assert model.recorded == _epoch0_order()[8:16]  # it did resume exactly
    # The loader carried the protocol only for Lightning's check: no loader state went into a file.
    assert "state_dict" not in vars(data) and "load_state_dict" not in vars(data)
    saved = torch.load(os.path.join(dirpath, "last.ckpt"), weights_only=False)
    assert saved["global_step"] == 4 and "combined_loader" not in saved["loops"]["fit_loop"]["state_dict"]

    # Without a ResumableDistributedSampler the resume is not exact, and Lightning says so.
    plain = torch.utils.data.DataLoader(data.dataset, batch_size=4)
    trainer = _trainer(Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=2), max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(IdModel(), plain, ckpt_path="last")
    assert len(_not_resumable_warnings(caught)) == 1


def test_a_pickled_copy_equals_the_original_and_carries_no_writer(tmp_path):
    import pickle

    ckpt = Rank0Checkpoint(dirpath=tmp_path, monitor="val_loss", async_save=True)
    copy = pickle.loads(pickle.dumps(ckpt))
    assert vars(copy) == vars(ckpt)
    ckpt._writer.wait()  # made at first use; a copy of a used callback still travels without it
    assert "_writer" in vars(ckpt) and vars(pickle.loads(pickle.dumps(ckpt))) == vars(copy)


class _MinimalTrainer:
    """Only what ModelCheckpoint._link_checkpoint reads."""

    is_global_zero = True

    class strategy:
        @staticmethod
        def barrier():
            pass


@pytest.mark.parametrize("on", ["class", "instance"])
def test_link_checkpoint_reads_only_is_global_zero_and_the_barrier(tmp_path, on):
    target, link = tmp_path / "a.ckpt", tmp_path / "last.ckpt"
    target.write_bytes(b"x")
    owner = Rank0Checkpoint if on == "class" else Rank0Checkpoint(dirpath=tmp_path)
    owner._link_checkpoint(_MinimalTrainer(), filepath=str(target), linkpath=str(link))
    assert os.readlink(link) == "a.ckpt"
    (tmp_path / "dir").mkdir()
    owner._link_checkpoint(_MinimalTrainer(), str(target), str(tmp_path / "dir"))  # a directory is replaced
    assert os.readlink(tmp_path / "dir") == "a.ckpt"


def test_a_fit_that_saves_nothing_leaves_no_directory(tmp_path):
    dirpath = tmp_path / "deep" / "ckpt"
    ckpt = Rank0Checkpoint(dirpath=str(dirpath), monitor="never_logged", save_top_k=1)
    _trainer(ckpt, max_steps=1, enable_checkpointing=True).fit(
        SequentialRegressor(), loader(regression_data(16), 4)
    )
    assert not (tmp_path / "deep").exists()


def test_an_unwritable_dirpath_still_fails_at_setup(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    ckpt = Rank0Checkpoint(dirpath=str(tmp_path / "file" / "ckpt"))
    with pytest.raises(ValueError, match="cannot write to dirpath"):
        _trainer(ckpt, max_steps=1).fit(SequentialRegressor(), loader(regression_data(16), 4))


@pytest.mark.parametrize("cls", [ModelCheckpoint, Rank0Checkpoint])
def test_signature_annotations_are_types_as_modelcheckpoints(cls):
    annotation = inspect.signature(cls).parameters["save_last"].annotation
    assert not isinstance(annotation, str)
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--save_last", type=annotation)
    assert [parser.parse_args(["--save_last", v]).save_last for v in ("link", "true", "null")] == [
        "link",
        True,
        None,
    ]
