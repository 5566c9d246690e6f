"""Rank0Checkpoint: ModelCheckpoint whose files are written once, atomically, verifiably, by global rank 0."""

# No ``from __future__ import annotations``: LightningCLI and other tools read the constructor's
# annotations with ``inspect.signature`` and use them as types, as they can ModelCheckpoint's.
import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.callbacks import _checkpoint_strategies as strategies
from lightning_parallel.callbacks._checkpoint_internals import (
    _dump_checkpoint,
    _VerifyingCheckpointIO,
    check_lightning_internals,
)
from lightning_parallel.callbacks._checkpoint_resume import (
    ResumingCheckpoint,
    nothing,
    remove_quietly,
)
from lightning_parallel.checkpoint.directory_async import background_writer
from lightning_parallel.distributed.agree import agree, decide_on
from lightning_parallel.distributed.collectives import min_over_ranks
from lightning_parallel.io import atomic
from lightning_parallel.io.async_writer import AsyncWriter, SnapshotBuffers

__all__ = ["CheckpointWriteError", "Rank0Checkpoint", "check_lightning_internals"]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; raised on every rank with rank 0's message."""


class _LinkCheckpoint:
    """A staticmethod ``(trainer, filepath, linkpath)`` that, read on an instance, also passes it."""

    def __get__(self, instance: ModelCheckpoint | None, owner: type | None = None) -> Callable[..., None]:
        return functools.partial(_link_checkpoint, instance)


class Rank0Checkpoint(ResumingCheckpoint):
    """``ModelCheckpoint`` with crash-safe files written once by global rank 0, and exact data resume.

    Same arguments and behaviour as Lightning's ``ModelCheckpoint`` (monitor, top-k, ``save_last``
    including ``"link"``, ``every_n_*``, filename templates), and the same ``state_key``: a run
    started with either callback resumes with the other and keeps ``best_model_path``,
    ``best_k_models`` and ``kth_value`` (the two in one Trainer with the same ``monitor``, ``mode``
    and ``every_n_*`` share that key, which Lightning refuses when the Trainer is built). Plus:

    * the checkpoint dict is built on every rank (``dump_checkpoint``, as ``trainer.save_checkpoint``
      does, so strategies that consolidate the state on rank 0 do so as usual); only global rank 0
      writes it. A strategy that leaves the state sharded (FSDP with ``state_dict_type="sharded"``,
      DeepSpeed, ``ModelParallelStrategy``) is refused at setup, naming the alternative;
    * each file is streamed into an unnamed ``O_TMPFILE`` file where the filesystem allows (else a
      named temp file beside it), fsynced, put in place in one link or rename, and the directory
      fsynced; a killed save leaves nothing (named temp files of a killed run are removed at the next
      start), and on resume the files a killed run wrote after the resumed checkpoint (or failed to
      evict) are removed;
    * each file carries its SHA-256 in the zip comment; ``ckpt_path="last"`` resumes from the newest
      file that verifies (warning about the ones that do not); an explicit corrupt ``ckpt_path`` is an
      error naming the file and the hash mismatch;
    * a failed write raises :class:`CheckpointWriteError` on every rank at once; an unwritable
      ``dirpath`` fails at setup;
    * ``async_save=True`` copies the state into CPU buffers (allocated at the first save and reused,
      pinned for CUDA tensors: +1.0x the checkpoint's size in host memory while fitting) and writes
      it on a background thread (one save in flight; all complete before ``fit`` returns); under
      ``PipelineStrategy(save_distributed_checkpoint=True)`` every rank does so for its own shards, the
      write's collectives on a gloo group of their own (``checkpoint.directory_async``);
    * a mid-epoch checkpoint records the data position of a :class:`ResumableDistributedSampler`,
      which then resumes exactly, also at another world size. Use it in the training loader:
      ``DataLoader(ds, batch_size=B, sampler=ResumableDistributedSampler(ds))``.

    Args:
        async_save: write in the background after a CPU snapshot of the state.
        Others: as ``lightning.pytorch.callbacks.ModelCheckpoint``.

    Raises:
        CheckpointWriteError: on every rank, when rank 0 could not write a checkpoint, or the state to
            save holds a sharded tensor (DTensor, ShardedTensor).
        ValueError: at setup when ``dirpath`` cannot be created or written, or the strategy saves
            sharded state.

    Example::

        ckpt = Rank0Checkpoint(dirpath="checkpoints", monitor="val_loss", save_top_k=3, save_last=True,
                               every_n_train_steps=500, async_save=True)
        trainer = L.Trainer(devices=8, strategy="ddp", callbacks=[ckpt])
        trainer.fit(model, datamodule, ckpt_path="last")
    """

    @checks_options
    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        async_save: bool = False,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}")
        self.async_save = async_save
        self._async_pending = False  # known on every rank: an async save was started and not yet confirmed
        self._init_resuming()

    # The background writer and the snapshot buffers are made at their first use, and like the loader
    # patch and the trainer they belong to one fit in one process: a pickled copy (a spawned rank, a
    # deep copy) travels without them, and its vars() equal the original's, as ModelCheckpoint's do.
    _PROCESS_LOCAL = ("_writer", "_snapshots", "_loader_unmark", "_trainer_ref")

    @functools.cached_property
    def _writer(self) -> AsyncWriter:
        return AsyncWriter()

    @functools.cached_property
    def _snapshots(self) -> SnapshotBuffers:
        return SnapshotBuffers()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in self._PROCESS_LOCAL}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._loader_unmark = nothing

    # --- setup: directory checks, orphan clean-up, verifying loads ------------------------------------

    @property
    @override
    def state_key(self) -> str:
        # ModelCheckpoint's key (Lightning prefixes the class name): either callback resumes the other.
        key, own = super().state_key, type(self).__qualname__
        return ModelCheckpoint.__qualname__ + key[len(own) :] if key.startswith(own) else key

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        problem = strategies.sharded_strategy_problem(trainer.strategy)
        if problem is not None:  # the same answer on every rank: no collective needed
            raise ValueError(f"Rank0Checkpoint writes one file from global rank 0, but {problem}.")
        if self.async_save and strategies.writes_directories(trainer.strategy):
            # Every rank writes in the background, on one writer per process: see directory_async.
            self.__dict__["_writer"] = background_writer()
        if self.save_top_k != 0 or self.save_last:
            decide_on(0, self._prepare_dir)
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, _VerifyingCheckpointIO):
            strategy.checkpoint_io = _VerifyingCheckpointIO(strategy.checkpoint_io, self._verified)

    def _prepare_dir(self) -> None:
        """On rank 0: check ``dirpath`` can be written, and remove a killed run's temporary files.

        A ``dirpath`` created for the check is removed after it: it is created again at the first save.
        """
        with atomic.created_for_now(str(self.dirpath)):
            problem = atomic.check_writable_dir(str(self.dirpath))
            if problem is not None:
                raise ValueError(
                    f"Rank0Checkpoint cannot write to dirpath {str(self.dirpath)!r}: {problem}. "
                    "Pass a dirpath that the job can create and write."
                )
            removed = atomic.remove_orphans(str(self.dirpath))
            if removed:
                rank_zero_info(f"Rank0Checkpoint removed {len(removed)} temporary file(s) of a killed run")
            method = atomic.temp_file_method(str(self.dirpath))
        rank_zero_info(f"Rank0Checkpoint writes into {method} temporary files in {str(self.dirpath)!r}")

    # --- saving ----------------------------------------------------------------------------------------

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        checkpoint = _dump_checkpoint(trainer, self.save_weights_only)
        if strategies.writes_directories(trainer.strategy):
            self._write_directory(trainer, checkpoint, filepath)
        else:
            error = None
            if trainer.is_global_zero:
                error = self._write_on_rank0(trainer, checkpoint, filepath)
            self._raise_on_all_ranks(trainer, error)
        self._async_pending = self.async_save
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _tag(self, trainer: pl.Trainer, filepath: str) -> dict[str, Any]:
        return {
            "step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "key": self.state_key,
            "name": os.path.basename(filepath),
        }

    def _write_directory(self, trainer: pl.Trainer, checkpoint: dict[str, Any], filepath: str) -> None:
        """Every rank writes its shards into a temporary directory that rank 0 renames into place.

        With ``async_save`` the writing, and its collectives on a group of their own, go on in the
        background of every rank after a copy of its state."""
        tag = self._tag(trainer, filepath)
        try:
            if self.async_save:
                strategies.save_directory_in_background(
                    trainer.strategy, checkpoint, filepath, tag, self._writer, self._snapshots
                )
            else:
                strategies.save_directory(trainer.strategy, checkpoint, filepath, tag)
        except Exception as err:  # raised on every rank (the save agrees on errors)
            raise CheckpointWriteError(f"Rank0Checkpoint failed: {_describe_error(err, filepath)}") from err

    def _write_on_rank0(self, trainer: pl.Trainer, checkpoint: dict[str, Any], filepath: str) -> str | None:
        meta = self._tag(trainer, filepath)
        try:
            strategies.refuse_sharded_tensors(checkpoint)
            os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
            if not self.async_save:
                atomic.save_checkpoint_file(checkpoint, filepath, meta)
                return None
            previous = self._writer.wait()
            if previous is not None:
                return _describe_error(previous, "previous background save")
            state = self._snapshots.snapshot(checkpoint)  # safe to overwrite: the previous write is done
            self._writer.submit(lambda: atomic.save_checkpoint_file(state, filepath, meta))
        except Exception as err:
            return _describe_error(err, filepath)
        return None

    def _raise_on_all_ranks(self, trainer: pl.Trainer, error: str | None) -> None:
        """Every rank raises rank 0's write error, or every rank goes on (rank 0 alone knows it)."""
        agree(CheckpointWriteError(f"Rank0Checkpoint failed on global rank 0: {error}") if error else None)

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            self._writer.after(lambda: remove_quietly(filepath))

    # Static in ModelCheckpoint (Lightning calls ``self._link_checkpoint(trainer, ...)``, tools call it
    # on the class): the same here, but a call on a callback also knows whose save to wait for.
    _link_checkpoint = _LinkCheckpoint()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches_done = batch_idx + 1
        if self._async_pending:
            self._poll_async(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _poll_async(self, trainer: pl.Trainer) -> None:
        """While a background save is unconfirmed, learn from rank 0 each step whether it ended or failed.

        A distributed checkpoint is written by every rank: every rank's writer is asked."""
        if strategies.writes_directories(trainer.strategy):
            done, err = self._writer.poll()
            try:
                agree(None if err is None else CheckpointWriteError(f"Rank0Checkpoint failed: {err}"))
            except BaseException:
                self._async_pending = False
                raise
            self._async_pending = min_over_ranks([float(done)])[0] == 0.0  # until every rank's is done
            return

        def poll() -> bool:
            done, err = self._writer.poll()
            if err is not None:
                raise CheckpointWriteError(
                    f"Rank0Checkpoint failed on global rank 0: {_describe_error(err, 'background save')}"
                )
            return done

        try:
            self._async_pending = not decide_on(0, poll)
        except CheckpointWriteError:
            self._async_pending = False
            raise

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        error = None
        if trainer.is_global_zero or strategies.writes_directories(trainer.strategy):
            err = self._writer.wait()
            error = _describe_error(err, "background save") if err else None
        self._async_pending = False
        self._raise_on_all_ranks(trainer, error)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._unmark_loader()
        if not isinstance(exception, CheckpointWriteError):
            super().on_exception(trainer, pl_module, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After an exception no collective is safe; just make sure no write is left half-done.
        error = self._writer.wait()
        self._snapshots.release()
        self._unmark_loader()
        if error is not None:
            rank_zero_warn(f"Rank0Checkpoint: {_describe_error(error, 'background save')}")


def _link_checkpoint(
    callback: Rank0Checkpoint | None, trainer: pl.Trainer, filepath: str, linkpath: str
) -> None:
    """Point ``linkpath`` at ``filepath`` with one rename, after ``callback``'s background save of it.

    Reads only ``trainer.is_global_zero`` and ``trainer.strategy.barrier``, as ModelCheckpoint's does.
    """
    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        if callback is not None:
            callback._writer.after(lambda: atomic.atomic_symlink(filepath, linkpath))
        else:
            atomic.atomic_symlink(filepath, linkpath)
    trainer.strategy.barrier()


def _describe_error(err: BaseException, where: str) -> str:
    """A failed write as a message: ``where: Type: text``, or the error's own text if it names ``where``."""
    text = str(err)
    return text if where in text else f"{where}: {type(err).__name__}: {text}"
