"""Rank0Checkpoint's resuming side: the newest checkpoint that verifies, mid-epoch data, stale files.

:class:`ResumingCheckpoint` is the ModelCheckpoint layer under :class:`~lightning_parallel.callbacks.
checkpoint.Rank0Checkpoint` (which writes): it resumes from the newest checkpoint of its directory that
verifies, saves and restores the position of a resumable sampler so a run resumed mid-epoch sees the
rest of that epoch's data, and removes the files an interrupted run wrote after its last tracked one.
"""

# No ``from __future__ import annotations``: as in checkpoint.py (tools read the annotations as types).
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel.callbacks._checkpoint_internals import (
    _mark_loader_resumable,
    _restart_epoch,
    _stat_key,
)
from lightning_parallel.checkpoint import directory
from lightning_parallel.data.resumable_sampler import find_resumable_samplers, single_loader_batch_size
from lightning_parallel.io import atomic


class ResumingCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that resumes from verified checkpoints and mid-epoch data (Rank0Checkpoint's base).

    Example::

        class Writer(ResumingCheckpoint):        # what Rank0Checkpoint does
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self._init_resuming()
    """

    def _init_resuming(self) -> None:
        self._verified: dict[str, tuple[int, int]] = {}  # path -> stat key of a checkpoint that verified
        self._resume_position: dict[str, Any] | None = None
        self._resume_batches = 0  # batches of the current epoch done before this run resumed it
        self._batches_done = 0  # batches of the current epoch done so far (including the resumed ones)
        self._loader_unmark: Callable[[], None] = nothing

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._unmark_loader()  # Lightning's resume check is behind us

    def _unmark_loader(self) -> None:
        undo, self._loader_unmark = self._loader_unmark, nothing
        undo()

    # --- resuming: which checkpoint, which data ---------------------------------------------------

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """The newest checkpoint in ``dirpath`` that verifies (each rank checks: no process group yet)."""
        dirpath = str(self.dirpath) if self.dirpath is not None else None
        entries = tagged_checkpoints(dirpath) if dirpath else []
        for path, _tag in atomic.newest_first(entries):
            verify = directory.verify_checkpoint_dir if os.path.isdir(path) else atomic.verify_checkpoint
            result = verify(path)
            if result.ok:
                self._verified[path] = _stat_key(path)
                return {path}
            rank_zero_warn(f"Rank0Checkpoint skips {result.describe()}")
        return super()._find_last_checkpoints(trainer) if not entries else set()

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["data_position"] = self._data_position
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._resume_position = state_dict.get("data_position")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._resume_data(trainer)
        if trainer.is_global_zero and trainer.ckpt_path is not None and self.dirpath is not None:
            self._remove_stale(trainer)

    def _remove_stale(self, trainer: pl.Trainer) -> None:
        """Delete files of ours that the resumed bookkeeping does not know: written after it, or evicted."""
        resumed = os.path.abspath(str(trainer.ckpt_path))
        if os.path.dirname(resumed) != os.path.abspath(str(self.dirpath)):
            return
        known = {
            os.path.abspath(p) for p in (*self.best_k_models, self.best_model_path, self.last_model_path) if p
        }
        known.add(resumed)
        for path, tag in tagged_checkpoints(str(self.dirpath)):
            if os.path.abspath(path) in known or tag.get("key") != self.state_key:
                continue
            if int(tag.get("step", -1)) > trainer.global_step or self.save_top_k != -1:
                rank_zero_info(f"Rank0Checkpoint removes {path!r}: left by the interrupted run, not tracked")
                remove_quietly(path)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not called when Lightning resumes mid-epoch: _resume_data (on_train_start) covers that.
        self._resume_batches = self._batches_done = 0

    def _resume_data(self, trainer: pl.Trainer) -> None:
        position, self._resume_position = self._resume_position, None
        self._resume_batches = self._batches_done = 0
        samplers = list(find_resumable_samplers(trainer.train_dataloader))
        batch_size = single_loader_batch_size(trainer.train_dataloader)
        if not position or len(samplers) != 1 or batch_size is None:
            return
        if position["sampler"]["epoch"] != trainer.current_epoch:
            return
        batches = position["batches"]
        samplers[0].load_state_dict(position["sampler"], offset=batches * batch_size)
        self._resume_batches = self._batches_done = batches
        _restart_epoch(trainer, len(trainer.train_dataloader))
        self._loader_unmark = _mark_loader_resumable(trainer.train_dataloader, samplers[0])
        rank_zero_info(
            f"Rank0Checkpoint resumes epoch {trainer.current_epoch} after {position['sampler']['consumed']}"
            f" samples ({batches} batches per replica before the restart)"
        )

    @property
    def _data_position(self) -> dict[str, Any] | None:
        trainer = self._trainer_ref
        if trainer is None:
            return None
        samplers = list(find_resumable_samplers(trainer.train_dataloader))
        batch_size = single_loader_batch_size(trainer.train_dataloader)
        if len(samplers) != 1 or batch_size is None:
            return None
        per_replica = (self._batches_done - self._resume_batches) * batch_size
        return {"batches": self._batches_done, "sampler": samplers[0].state_dict(per_replica)}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer_ref = trainer

    _trainer_ref: pl.Trainer | None = None


def nothing() -> None:
    pass


def tagged_checkpoints(dirpath: str) -> list[tuple[str, dict[str, Any]]]:
    """Our checkpoint files and distributed checkpoint directories in ``dirpath``, with their tags."""
    return atomic.list_tagged_checkpoints(dirpath) + directory.list_tagged_dirs(dirpath)


def remove_quietly(path: str) -> None:
    try:
        directory.remove_dir(path) if os.path.isdir(path) else atomic.remove_file(path)
    except OSError as err:
        rank_zero_warn(f"Rank0Checkpoint could not remove old checkpoint {path!r}: {err}")
