"""Rank0Checkpoint under a real Trainer: loud failures, verified resume, exact mid-epoch data position.

Covers callbacks/_checkpoint_internals.py (the Lightning internals check, the verifying CheckpointIO, the
restarted epoch) and callbacks/_checkpoint_resume.py (the newest checkpoint that verifies, the mid-epoch data
position) through Rank0Checkpoint.
"""

import os
import shutil
import time

import lightning as L
import pytest
import torch
from mp_harness import RankRecorder, ddp_spawn, load_rank_results
from tiny_models import SequentialRegressor, regression_data
from torch.utils.data import DataLoader, Dataset

from lightning_parallel.callbacks.checkpoint import (
    CheckpointWriteError,
    Rank0Checkpoint,
    check_lightning_internals,
)
from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler
from lightning_parallel.io import atomic

N_SAMPLES, BATCH = 48, 4


class IdDataset(Dataset):
    def __init__(self, n: int = N_SAMPLES) -> None:
        self.data = regression_data(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return torch.tensor(i), x, y


class IdModel(SequentialRegressor):
    """Records the sample ids of every training batch, in order."""

    def __init__(self, bad_on_rank0: bool = False) -> None:
        super().__init__()
        self.recorded: list[int] = []
        self.bad_on_rank0 = bad_on_rank0

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.recorded.extend(ids.tolist())
        return super().training_step((x, y), batch_idx)

    def on_save_checkpoint(self, checkpoint):
        if self.bad_on_rank0 and self.trainer.is_global_zero:
            checkpoint["unpicklable"] = lambda: 0


class RecordingCheckpoint(Rank0Checkpoint):
    """Rank0Checkpoint that writes the error each rank raises to ``record_dir/exc-rank{R}.txt``.

    Under ``ddp_spawn`` a worker's exception never reaches ``on_exception`` in that worker (the
    launcher reports it to the parent), so the test records it where Rank0Checkpoint raises it.
    """

    def __init__(self, record_dir, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record_dir = str(record_dir)

    def _record(self, trainer, fn, *args):
        try:
            return fn(*args)
        except Exception as err:
            os.makedirs(self.record_dir, exist_ok=True)
            path = os.path.join(self.record_dir, f"exc-rank{trainer.global_rank}.txt")
            with open(path, "w") as f:
                f.write(f"{type(err).__name__}: {err}")
            if trainer.global_rank == 0:
                # The launcher stops the other ranks once rank 0's error arrives: let them record first.
                names = [f"exc-rank{r}.txt" for r in range(trainer.world_size)]
                others = [os.path.join(self.record_dir, n) for n in names]
                deadline = time.monotonic() + 10
                while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
                    time.sleep(0.02)
            raise

    def setup(self, trainer, pl_module, stage):
        self._record(trainer, super().setup, trainer, pl_module, stage)

    def _save_checkpoint(self, trainer, filepath):
        self._record(trainer, super()._save_checkpoint, trainer, filepath)


def _loader() -> DataLoader:
    ds = IdDataset()
    return DataLoader(ds, batch_size=BATCH, sampler=ResumableDistributedSampler(ds))


def _fit(out_dir, devices, ckpt, ckpt_path=None, model=None, **kwargs):
    strategy = ddp_spawn() if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, RankRecorder(out_dir)],
        **kwargs,
    )
    trainer.fit(model or IdModel(), train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return load_rank_results(out_dir, "fit")


def _ids(records) -> list[int]:
    return [i for r in records for i in r["extra"]]


def _epoch0_order() -> list[int]:
    s = ResumableDistributedSampler(range(N_SAMPLES), seed=0)
    return s.global_order()


def test_lightning_internals_are_where_we_expect():
    check_lightning_internals()


def test_bad_arguments():
    with pytest.raises(TypeError, match="async_save"):
        Rank0Checkpoint(async_save="yes")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_uncreatable_dirpath_fails_at_setup_on_every_rank(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    dirpath = str(blocker / "ckpts")
    with pytest.raises(Exception, match="cannot write to dirpath"):
        _fit(tmp_path / "out", 2, RecordingCheckpoint(tmp_path / "out", dirpath=dirpath))
    for rank in (0, 1):
        text = (tmp_path / "out" / f"exc-rank{rank}.txt").read_text()
        assert "ValueError" in text and dirpath in text and "NotADirectoryError" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_serialization_failure_on_rank0_ends_every_rank(tmp_path):
    ckpt = RecordingCheckpoint(tmp_path / "out", dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    with pytest.raises(Exception, match="CheckpointWriteError"):
        _fit(tmp_path / "out", 2, ckpt, model=IdModel(bad_on_rank0=True))
    for rank in (0, 1):
        text = (tmp_path / "out" / f"exc-rank{rank}.txt").read_text()
        assert "CheckpointWriteError" in text and "step=2.ckpt" in text and "pickle" in text
    assert not list((tmp_path / "ckpt").iterdir())  # neither a checkpoint nor a temp file


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_during_a_save_says_so_and_keeps_the_earlier_checkpoints(
    tmp_path, monkeypatch, async_save
):
    from test_atomic_io import fill_disk_after

    dirpath = tmp_path / "ckpt"
    ckpt = Rank0Checkpoint(dirpath=str(dirpath), every_n_train_steps=2, save_top_k=-1, async_save=async_save)
    saves = []
    write = atomic.save_checkpoint_file

    def save_then_fill(*args, **kwargs):  # the disk is full from the second save on
        saves.append(args[1])
        if len(saves) == 2:
            fill_disk_after(monkeypatch, 1000)
        return write(*args, **kwargs)

    monkeypatch.setattr(atomic, "save_checkpoint_file", save_then_fill)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False, callbacks=[ckpt]
    )
    match = r"failed on global rank 0: .*step=4\.ckpt': the disk is full .* needs at least \d+ bytes .* free"
    with pytest.raises(CheckpointWriteError, match=match):
        trainer.fit(IdModel(), train_dataloaders=_loader())
    assert os.listdir(dirpath) == ["epoch=0-step=2.ckpt"]  # no temp file, the earlier checkpoint kept
    assert atomic.verify_checkpoint(str(dirpath / "epoch=0-step=2.ckpt")).ok


def test_corrupt_last_is_skipped_and_explicit_corrupt_path_is_an_error(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    ckpt = Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)
    _fit(tmp_path / "a", 1, ckpt, max_steps=4)
    last = os.path.join(dirpath, "last.ckpt")
    assert atomic.verify_checkpoint(last).ok
    with open(last, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 3] ^= 0xFF
    with open(last, "wb") as f:
        f.write(bytes(data))

    ckpt = Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)
    with pytest.warns(UserWarning, match=r"skips checkpoint .*last\.ckpt.* hash mismatch"):
        records = _fit(tmp_path / "b", 1, ckpt, max_steps=6, ckpt_path="last")
    # Resumed from step 4 (the newest file that verifies): only steps 5 and 6 ran, 8 samples.
    assert len(records[0]["extra"]) == 2 * BATCH

    bad = os.path.join(dirpath, "epoch=0-step=4.ckpt")
    with open(bad, "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage")
    with pytest.raises(ValueError, match=r"epoch=0-step=4\.ckpt.*hash mismatch"):
        _fit(tmp_path / "c", 1, Rank0Checkpoint(dirpath=dirpath), max_steps=6, ckpt_path=bad)


@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_exact_mid_epoch_resume_at_same_and_different_world_size(tmp_path):
    order = _epoch0_order()
    # Uninterrupted reference (1 process sees the whole global order).
    ref = _ids(_fit(tmp_path / "ref", 1, Rank0Checkpoint(dirpath=str(tmp_path / "ref_ckpt"))))
    assert ref == order

    # 2 processes, stop after 2 steps (16 samples), asynchronous save.
    first = str(tmp_path / "ckpt2")
    ckpt = Rank0Checkpoint(dirpath=first, every_n_train_steps=2, save_last=True, async_save=True)
    phase1 = _ids(_fit(tmp_path / "p1", 2, ckpt, max_steps=2))
    assert sorted(phase1) == sorted(order[:16])
    # The async save was complete when fit returned.
    assert atomic.verify_checkpoint(os.path.join(first, "last.ckpt")).ok

    for devices in (2, 1):
        dirpath = str(tmp_path / f"resume_at_{devices}")
        shutil.copytree(first, dirpath)
        ckpt = Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)
        rest = _ids(_fit(tmp_path / f"p2_{devices}", devices, ckpt, ckpt_path="last"))
        assert sorted(phase1 + rest) == sorted(ref), f"2 -> {devices}"
        if devices == 1:
            assert rest == order[16:]

    # 1 process, stop after 3 steps (12 samples); resume on 2 processes.
    dirpath = str(tmp_path / "ckpt1")
    ckpt = Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=3, save_last=True)
    phase1 = _ids(_fit(tmp_path / "q1", 1, ckpt, max_steps=3))
    assert phase1 == order[:12]
    ckpt = Rank0Checkpoint(dirpath=dirpath, every_n_train_steps=3, save_last=True)
    rest = _fit(tmp_path / "q2", 2, ckpt, ckpt_path="last")
    assert sorted(phase1 + _ids(rest)) == sorted(ref), "1 -> 2"
    assert rest[0]["extra"] == order[12::2] and rest[1]["extra"] == order[13::2]
