"""Lightning 2.6.6 internals Rank0Checkpoint relies on, and the CheckpointIO that verifies before loading."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_parallel.callbacks._checkpoint_strategies import check_strategy_internals
from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler
from lightning_parallel.io import atomic

# --- Lightning internals (checked against Lightning 2.6.6) --------------------------------------------
# No public hook builds the checkpoint dict without also writing it through the strategy's
# CheckpointIO (``trainer.save_checkpoint``), or re-positions the data of a resumed epoch.
# ModelCheckpoint's own customisation points are underscored methods. Everything private this
# module touches is listed here or in ``_restart_epoch``; ``check_lightning_internals`` (run by the
# tests) fails loudly when one of them moves.
_OVERRIDDEN = ("_save_checkpoint", "_remove_checkpoint", "_link_checkpoint", "_find_last_checkpoints")


def _dump_checkpoint(trainer: pl.Trainer, weights_only: bool) -> dict[str, Any]:
    """Build the checkpoint dict the way ``trainer.save_checkpoint`` does (call on every rank)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only)


def check_lightning_internals() -> None:
    """Raise RuntimeError if a Lightning internal this callback relies on has moved."""
    problems = [name for name in _OVERRIDDEN if not callable(getattr(ModelCheckpoint, name, None))]
    if not callable(getattr(_CheckpointConnector, "dump_checkpoint", None)):
        problems.append("_CheckpointConnector.dump_checkpoint")
    if "_find_last_checkpoints" not in inspect.getsource(_CheckpointConnector._parse_ckpt_path):
        problems.append("_CheckpointConnector._parse_ckpt_path no longer asks _find_last_checkpoints")
    if "self._save_checkpoint(" not in inspect.getsource(ModelCheckpoint._save_last_checkpoint):
        problems.append("ModelCheckpoint._save_last_checkpoint no longer calls _save_checkpoint")
    loop_src = inspect.getsource(_FitLoop.setup_data)
    if "iter(self._data_fetcher)" not in loop_src or "combined_loader.limits" not in loop_src:
        problems.append("_FitLoop.setup_data no longer creates the iterator/limits as _restart_epoch expects")
    if "isinstance(loader, _Stateful)" not in inspect.getsource(_TrainingEpochLoop.reset):
        problems.append("_TrainingEpochLoop.reset no longer asks _Stateful before warning 'not resumable'")
    problems += check_strategy_internals()
    if problems:
        raise RuntimeError(
            f"Rank0Checkpoint relies on Lightning 2.6.6 internals that changed: {problems}; "
            "pin lightning==2.6.6 or update lightning_parallel/callbacks/_checkpoint_internals.py"
        )


class _VerifyingCheckpointIO(CheckpointIO):
    """Delegates to the strategy's CheckpointIO, but checks a tagged file's hash before loading it."""

    def __init__(self, inner: CheckpointIO, verified: dict[str, tuple[int, int]]) -> None:
        self.inner = inner
        self._verified = verified

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, **kwargs: Any) -> dict[str, Any]:
        path = str(path)
        if os.path.isfile(path) and _stat_key(path) != self._verified.get(path):
            result = atomic.verify_checkpoint(path)
            if result.status == "mismatch":
                raise ValueError(f"{result.describe()}: resume from another checkpoint or ckpt_path='last'")
            if result.ok:
                self._verified[path] = _stat_key(path)
        if map_location is None:
            return self.inner.load_checkpoint(path, **kwargs)
        return self.inner.load_checkpoint(path, map_location=map_location, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _stat_key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _restart_epoch(trainer: pl.Trainer, num_batches: int) -> None:
    """Re-create the training data iterator after the sampler moved to the resume point (Lightning 2.6.6).

    The fit loop creates the iterator, and prefetches a batch, in ``setup_data`` before any
    callback hook of the epoch runs, and sizes the epoch from the sampler's length at that time.
    """
    loop = trainer.fit_loop
    combined = loop._combined_loader
    if combined is not None and combined.limits is not None:
        combined.limits = [num_batches for _ in combined.limits]
    if getattr(trainer, "val_check_batch", None) == loop.max_batches:
        trainer.val_check_batch = num_batches  # validation "at the end of the epoch" stays there
    loop.max_batches = num_batches  # trainer.num_training_batches
    iter(loop._data_fetcher)


def _mark_loader_resumable(loader: Any, sampler: ResumableDistributedSampler) -> Callable[[], None]:
    """Let Lightning 2.6.6 see that ``loader`` resumed exactly; return the undo function.

    After a mid-epoch restart ``_TrainingEpochLoop.reset`` warns that "your dataloader is not
    resumable" unless every train loader has ``state_dict``/``load_state_dict`` (``_Stateful``).
    Rank0Checkpoint has just put the sampler at its exact position, so the loader carries the
    sampler's methods for that check. They come off at the first batch: while they are on, the fit
    loop would also save a loader state into checkpoints, which a resume without Rank0Checkpoint
    could not load.
    """
    own = vars(loader)
    if "state_dict" in own or "load_state_dict" in own or isinstance(loader, _Stateful):
        return lambda: None  # stateful already: Lightning does not warn
    loader.state_dict = sampler.state_dict
    loader.load_state_dict = sampler.load_state_dict

    def undo() -> None:
        vars(loader).pop("state_dict", None)
        vars(loader).pop("load_state_dict", None)

    return undo
