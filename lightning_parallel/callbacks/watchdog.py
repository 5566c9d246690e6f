"""HangWatchdog: a distributed hang becomes one report of which rank is where, and a non-zero exit.

Lightning glue only: the hooks tell the ground floor (:mod:`lightning_parallel.distributed.watchdog`)
which hook and step each rank is in; the monitor, the report and the exit live there.
"""

import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed import DistBackendError
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.distributed.agree import distributed_ready
from lightning_parallel.distributed.watchdog import EXIT_CODE, Watchdog, check_timeout

__all__ = ["HangWatchdog"]

DDP_BACKWARD = "DDP gradient all-reduce"
"""What a rank in backward under DDP waits in: the all-reduce torch's C++ reducer issues, not trackable."""


class HangWatchdog(Callback):
    """Turn a distributed hang into a prompt report of which rank is where, and a non-zero exit.

    Every rank keeps, in memory, where it is: inside a collective (op, group, per-group sequence number,
    the line of your code that called it), or computing (the Lightning hook and step). A background
    thread per rank publishes that once a second to an out-of-band store. When a rank has waited in a
    communication for longer than ``timeout`` while a rank it waits for is not in the matching one, the
    lowest live rank prints one report to stderr (a table of the ranks, every rank's main-thread stack
    with your frames marked, and a one-line diagnosis), and every process exits with code 1 within
    ``timeout`` + 30 s. A rank that dies (SIGKILL, OOM killer) is reported as gone in the same time. A
    step that computes for longer than ``timeout`` on every rank is slow, not hung: no report.

    Works with any strategy (``ddp``, ``ddp_spawn``, ``ddp_notebook``, FSDP, :class:`PipelineStrategy`)
    and launcher, on gloo and NCCL. With a single process it does nothing and says so.

    Args:
        timeout: seconds (a number, or a ``datetime.timedelta``); pick it above the longest time any rank
            computes between two communications its peers wait on.
        report_path: also write the report to this file (on the machine of the reporting rank).

    Raises:
        ValueError: ``timeout`` is not a positive, finite duration.
        TypeError: ``timeout`` is neither a number nor a ``timedelta``.

    Example::

        from lightning_parallel import HangWatchdog
        trainer = L.Trainer(devices=8, strategy="ddp", callbacks=[HangWatchdog(timeout=300)])
    """

    leaves_gradients_alone = True
    """Its backward hooks only note where the rank is: the overlapped gradient reduction stays on."""

    @checks_options
    def __init__(
        self, timeout: float | timedelta = 300.0, report_path: str | os.PathLike | None = None
    ) -> None:
        self.timeout = check_timeout(timeout)
        self.report_path = None if report_path is None else os.fspath(report_path)
        self._watchdog: Watchdog | None = None

    # ------------------------------------------------------------------------- start and stop
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size == 1 or not distributed_ready():
            rank_zero_info(
                "HangWatchdog: a single process cannot hang on its peers; the watchdog does nothing."
            )
            return
        self._stop()  # a watchdog of an earlier stage whose teardown never came
        watchdog = Watchdog(self.timeout, self.report_path, on_exit=_end_launched_ranks(trainer))
        watchdog.start()  # a collective: every rank calls setup at the same point
        self._watchdog = watchdog
        where = f" and to {self.report_path}" if self.report_path else ""
        rank_zero_info(
            f"HangWatchdog: watching {trainer.world_size} ranks; a rank waiting over {self.timeout:g} s for "
            f"a peer ends the run with a report on stderr{where} and exit code {EXIT_CODE}."
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # A collective that failed because a peer died (gloo: "Connection closed by peer"): the report
        # names that rank once its heartbeat is gone long enough, and every rank exits with it.
        if self._watchdog is not None and is_peer_failure(exception):
            self._watchdog.await_verdict()
        self._stop()

    def _stop(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def _enter(self, trainer: pl.Trainer, hook: str, waits_in: str | None = None) -> None:
        if self._watchdog is not None:
            self._watchdog.activity.enter_hook(hook, trainer.global_step, waits_in)

    # ------------------------------------------------------------------ where the main thread is
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._enter(trainer, "training_step")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        # DDP's all-reduce runs inside backward, from C++: the hook is all we can see of it.
        ddp = isinstance(trainer.strategy.model, DistributedDataParallel)
        self._enter(trainer, "backward", DDP_BACKWARD if ddp else None)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_after_backward")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._enter(trainer, "optimizer_step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._enter(trainer, "on_train_batch_end")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_train_epoch_start")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_train_epoch_end")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_validation_start")

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._enter(trainer, "validation_step")

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._enter(trainer, "on_validation_batch_end")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_validation_epoch_end")

    @override
    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._enter(trainer, "test_step")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_test_epoch_end")

    @override
    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._enter(trainer, "predict_step")

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "on_predict_epoch_end")


_PEER_FAILURE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator")


def is_peer_failure(exception: BaseException) -> bool:
    """Whether ``exception`` (or what caused it) is a collective that failed on a lost peer."""
    seen: set[int] = set()
    error: BaseException | None = exception
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DistBackendError) or any(t in str(error) for t in _PEER_FAILURE_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _end_launched_ranks(trainer: pl.Trainer) -> Callable[[], None] | None:
    """Under the script launcher rank 0 started the other ranks: it ends them before it exits.

    (They exit by themselves when they read the verdict; this is for one whose watchdog cannot.) Under
    spawn/fork the parent process ends the ranks, under torchrun/SLURM the launcher does.
    """
    launcher = trainer.strategy.launcher
    if isinstance(launcher, _SubprocessScriptLauncher):
        return functools.partial(launcher.kill, _get_sigkill_signal())
    return None
