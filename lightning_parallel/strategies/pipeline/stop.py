"""PipelineStrategy's stop path: every rank ends after a stop signal, Lightning's own SIGTERM handling kept.

Lightning glue over :mod:`lightning_parallel.distributed.stop`. Each rank starts a
:class:`~lightning_parallel.distributed.stop.StopGuard` (``grace`` seconds from a SIGTERM/SIGINT to its
hard exit) knowing who launched it: this package's spawn/fork launcher, rank 0 of a script launch, or
torchrun's agent; the rank dies with that launcher.

Lightning 2.6.6 answers SIGTERM in each rank by setting ``trainer.received_sigterm``, on which the fit
loop raises ``SIGTERMException`` (``on_exception`` hooks such as ``ModelCheckpoint(save_on_exception=
True)`` then run), and by forwarding the signal to the ranks a script launch started. Two parts of it
hang a distributed job: its handler runs a ``broadcast`` inside the signal handler (on a rank that gets
the signal alone, or between two collectives of training, it pairs with another collective), and each
rank checks its own flag at the end of a batch, so ranks that got the signal a moment apart stop at
different batches (one in the ``on_exception`` save, the other in the next step). Here the handler
keeps its other work without the collective (:func:`keep_lightning_sigterm_handling`), and while
fitting the flag is raised on every rank at once, in the same training batch, once any rank was told
to stop (:class:`StopAgreement`, one all-reduce of one number per batch, read a batch later so no
rank waits for it; it replaces Lightning's own per-batch broadcast of rank 0's flag).

SIGINT (Ctrl-C) takes Lightning's KeyboardInterrupt path, agreed the same way. Python raises
``KeyboardInterrupt`` wherever a rank's main thread is when the signal lands: a pipeline rank outside a
communication (the slow stage's) went on to ``on_exception`` (a ``save_on_exception`` checkpoint, a
collective) while its peer sat in a point-to-point wait for it, until the grace period ended both.
While fitting, SIGINT is noted instead (:func:`defer_interrupts`) and every rank raises
:class:`StopInterrupt`, a ``KeyboardInterrupt``, in the same batch. The private pieces of Lightning's
signal machinery this reads are here only (checked against 2.6.6 by :func:`check_signal_internals`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import (
    _get_sigkill_signal,
    _HandlersCompose,
    _SignalConnector,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from typing_extensions import override

from lightning_parallel.distributed.agree import PostedVote, world_size
from lightning_parallel.distributed.stop import LAUNCHER_PID_ENV, StopGuard, current_guard, exit_status

__all__ = [
    "StopAgreement",
    "StopHooks",
    "StopInterrupt",
    "check_signal_internals",
    "defer_interrupts",
    "keep_lightning_sigterm_handling",
    "mark_stopped_exit",
    "replace_lightning_stop_broadcast",
    "start_rank_guard",
]

log = logging.getLogger(__name__)
_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every worker it starts


def start_rank_guard(strategy: Any, grace: float) -> tuple[StopGuard | None, bool]:
    """This rank's guard, and whether it was started here (False: its launcher's, or none).

    None for one process or off the main thread. The launcher is the pid in
    ``LIGHTNING_PARALLEL_LAUNCHER_PID`` (rank 0 of a script launch) or torchrun's agent (the parent).
    """
    guard = current_guard()
    if guard is not None or strategy.world_size < 2:
        return guard, False
    if threading.current_thread() is not threading.main_thread():
        return None, False
    launcher = None
    if os.environ.get(LAUNCHER_PID_ENV):
        launcher = int(os.environ[LAUNCHER_PID_ENV])
    elif os.environ.get(_TORCHRUN_ENV):
        launcher = os.getppid()
    on_hard_exit = None
    if isinstance(strategy.launcher, _SubprocessScriptLauncher) and strategy.launcher.procs:
        on_hard_exit = lambda: strategy.launcher.kill(_get_sigkill_signal())  # noqa: E731
    name = f"rank {strategy.global_rank}"
    return StopGuard(grace, name, launcher, on_hard_exit).start(), True


def mark_stopped_exit(exception: BaseException, signum: int | None = None) -> None:
    """Give Lightning's ``SIGTERMException`` (exit status 0) the status of a stopped process, 128 + signal.

    The signal is ``signum`` (the one the ranks agreed on), else the one this rank's guard saw first.
    """
    if isinstance(exception, SIGTERMException) and not exception.code:
        guard = current_guard()
        if not signum:
            signum = guard.signum if guard is not None and guard.signum is not None else signal.SIGTERM
        exception.code = exit_status(signum)


class StopInterrupt(KeyboardInterrupt):
    """The ``KeyboardInterrupt`` every rank raises in the same training batch after a SIGINT to any rank.

    Lightning takes it for a Ctrl-C (its ``except KeyboardInterrupt``): ``on_exception`` hooks run on
    every rank together, and the main process exits with status 1. See :class:`StopAgreement`.

    Example::

        raise StopInterrupt("SIGINT: every rank stops at batch 12")
    """


class StopAgreement:
    """Every rank, once per training batch: stop every rank in the same batch if one rank was stopped.

    One vote (:class:`~lightning_parallel.distributed.agree.PostedVote`) per batch, off the critical
    path: posted at the start of a batch and read at the start of the next one, by when every rank has
    long joined it (each posts it at the same point of the same batch). A stop signal is seen one batch
    after it arrived, on every rank in the same batch. After SIGTERM Lightning's stop flag rises there
    and Lightning stops every rank at the end of that batch; after SIGINT every rank raises
    :class:`StopInterrupt` there (SIGINT only noted while fitting: :meth:`start`). Each rank votes the
    signal its guard saw (its thread saw it even if the Python handler has not run yet); the highest
    wins, so a SIGTERM to any rank stops the job the SIGTERM way.

    It also stands in for Lightning's own per-batch broadcast of rank 0's SIGTERM flag (see
    :func:`replace_lightning_stop_broadcast`), so a batch pays for one collective of one number.

    Example::

        agreement = StopAgreement()
        agreement.start(trainer)          # when training starts: SIGINT noted, not raised
        agreement.at_batch(trainer)       # in training_step, before the pipeline runs
        agreement.finish()                # once training ends: the last one posted is waited for
    """

    def __init__(self) -> None:
        self._pending: PostedVote | None = None
        self._deferring = False
        self.signum = 0
        """The stop signal every rank agreed on (0: none yet)."""

    def start(self, trainer: Any) -> None:
        """Note SIGINT for the agreement instead of raising it where it lands, until :meth:`release`."""
        self.signum = 0
        self._deferring = self._deferring or defer_interrupts(trainer.local_rank)

    def at_batch(self, trainer: Any) -> None:
        if world_size() < 2:
            return
        signum = self._take()
        if signum:
            self._agreed(signum)
            if signum == signal.SIGINT:
                raise StopInterrupt("SIGINT: every rank of the job stops at this training batch")
            _set_received_sigterm(trainer)
        guard = current_guard()
        self._pending = PostedVote(_seen(guard))

    def finish(self) -> int:
        """Wait for the agreement posted last (every rank posted it) and give SIGINT back to Python.

        Returns the signal it agreed on (0: none); SIGINT raises :class:`StopInterrupt` on every rank.
        A SIGINT that came too late for a vote is raised on its rank, as Python would have.
        """
        signum = self._take()
        deferred = self.release()
        if signum == signal.SIGINT:
            self._agreed(signum)
            raise StopInterrupt("SIGINT: every rank stops as training ends")
        guard = current_guard()
        if deferred and not signum and guard is not None and guard.signum == signal.SIGINT:
            raise KeyboardInterrupt
        return signum

    def release(self) -> bool:
        """Give SIGINT back to Python (KeyboardInterrupt) if :meth:`start` took it; whether it had."""
        deferring, self._deferring = self._deferring, False
        if deferring and isinstance(signal.getsignal(signal.SIGINT), _InterruptNoter):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return deferring

    def _agreed(self, signum: int) -> None:
        self.signum = signum
        guard = current_guard()
        if guard is not None:  # a rank a peer's signal stops is held to the grace period too
            guard.note(signum)

    def _take(self) -> int:
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else 0


def _seen(guard: StopGuard | None) -> int:
    """The stop signal this rank's guard saw (0: none)."""
    return 0 if guard is None or guard.signum is None else guard.signum


class _InterruptNoter:
    """SIGINT while fitting: noted in this rank's stop guard for :class:`StopAgreement`, not raised here."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        guard = current_guard()
        if guard is None:
            raise KeyboardInterrupt  # no agreement without the guard: Python's own handling
        guard.note(signum)
        log.info(rank_prefixed_message(f"Received SIGINT: {signum}, every rank stops at a batch", self.rank))


def defer_interrupts(rank: int) -> bool:
    """SIGINT noted in this rank's stop guard instead of raised as ``KeyboardInterrupt`` where it lands.

    Only in the main thread, with a stop guard running (:class:`StopAgreement` reads it), and in place
    of Python's own handler (a handler of the user's, or an ignored SIGINT, stays). Returns whether it
    took SIGINT over; :meth:`StopAgreement.release` gives it back.

    Example::

        if defer_interrupts(trainer.local_rank):    # when training starts
            ...                                      # a Ctrl-C now stops every rank at one batch
    """
    if threading.current_thread() is not threading.main_thread() or current_guard() is None:
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _InterruptNoter(rank))
    return True


class StopHooks:
    """A mixin of ``PipelineStrategy``: its Lightning hooks on the stop path (see the module docstring).

    Reads the strategy's ``launcher``, ``lightning_module``, ``_stop_agreement`` and ``_stop_guard``.
    """

    launcher: Any
    lightning_module: Any
    _stop_agreement: StopAgreement
    _stop_guard: StopGuard | None

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        # a stop ends with 128 + the signal, not Lightning's status 0
        mark_stopped_exit(exception, self._stop_agreement.signum)
        # Under the script launcher the ranks this process started may be blocked on it in a
        # point-to-point receive (with NCCL until the process-group timeout): end them now, so
        # the job stops with this rank's error. Lightning does the same on KeyboardInterrupt. A
        # stop signal stops them at the same batch as this rank (their own hooks still run; on
        # a StopInterrupt Lightning ends them once this rank's teardown is done).
        stopped = isinstance(exception, SIGTERMException | StopInterrupt)
        if isinstance(self.launcher, _SubprocessScriptLauncher) and not stopped:
            self.launcher.kill(_get_sigkill_signal())

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        keep_lightning_sigterm_handling(self.lightning_module.trainer)
        replace_lightning_stop_broadcast(self.lightning_module.trainer)
        self._stop_agreement.start(self.lightning_module.trainer)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        self._stop_agreement.finish()  # (every rank posted it: the training loop ran the same batches)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        keep_lightning_sigterm_handling(self.lightning_module.trainer)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()  # type: ignore[misc]
        keep_lightning_sigterm_handling(self.lightning_module.trainer)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        keep_lightning_sigterm_handling(self.lightning_module.trainer)

    @override
    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        self._stop_agreement.release()  # (after an exception: on_train_end did not run)
        guard, self._stop_guard = self._stop_guard, None
        if guard is not None:
            guard.stop()  # a deadline a stop signal armed stays armed


def replace_lightning_stop_broadcast(trainer: Any) -> None:
    """Drop Lightning's per-batch broadcast of rank 0's SIGTERM flag while :class:`StopAgreement` runs.

    Lightning 2.6.6's training epoch loop broadcasts ``trainer.received_sigterm`` from rank 0 at the
    start of every batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``, private). The agreement
    already carries rank 0's signal with every other rank's, so the broadcast only adds a collective
    (about 1.5 ms on 2 CPU ranks) to each step. Replaced on this trainer's loop only, and only when
    this rank's stop guard runs (the agreement's flag is the guard's).
    """
    if current_guard() is None:
        return
    loop = trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor = _no_broadcast


def _no_broadcast() -> None:
    """In place of Lightning's SIGTERM broadcast: :class:`StopAgreement` raises the flag on every rank."""


# --- Lightning's signal connector (private; checked against Lightning 2.6.6) ---------------------------
def _set_received_sigterm(trainer: Any) -> None:
    trainer._signal_connector.received_sigterm = True


# Lightning workaround: no upstream issue found
#   canary: test_lightning_sigterm_handler_runs_no_collective
class _StopNotifier:
    """Lightning's ``_sigterm_notifier_fn`` without the collective it runs inside the handler.

    While fitting, the stop flag is raised by :class:`StopAgreement` (on every rank in the same batch);
    otherwise (validate, test, predict) here, as Lightning does.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        guard = current_guard()
        if guard is not None:
            guard.note(signum)
        trainer = self.trainer
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        if not trainer._signal_connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # a script launch: on to the ranks rank 0 started
        if trainer.state.fn != TrainerFn.FITTING or guard is None:
            _set_received_sigterm(trainer)


def keep_lightning_sigterm_handling(trainer: Any) -> None:
    """Swap Lightning's SIGTERM notifier (registered for this run) for one that runs no collective.

    Lightning's other SIGTERM handlers (SLURM's, a handler the user had) stay, in their order. Call it
    once the Trainer has registered its handlers (the strategy's ``on_*_start`` hooks); the Trainer's
    teardown puts back the handlers of before the run, as it does for its own.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if not isinstance(current, _HandlersCompose):
        return
    handlers = current.signal_handlers
    if any(isinstance(h, _StopNotifier) for h in handlers):
        return
    notifier = trainer._signal_connector._sigterm_notifier_fn
    rest = [h for h in handlers if h != notifier]
    if len(rest) == len(handlers):
        return  # not the handler Lightning registered for this trainer
    signal.signal(signal.SIGTERM, _HandlersCompose([_StopNotifier(trainer), *rest]))


def check_signal_internals() -> list[str]:
    """The private pieces of Lightning's signal handling used above that are gone (Lightning 2.6.6)."""
    problems = []
    if not isinstance(getattr(_HandlersCompose([]), "signal_handlers", None), list):
        problems.append("_HandlersCompose.signal_handlers")
    for name in ("_sigterm_notifier_fn", "register_signal_handlers"):
        if not callable(getattr(_SignalConnector, name, None)):
            problems.append(f"_SignalConnector.{name}")
    if not callable(getattr(_SubprocessScriptLauncher, "_call_children_scripts", None)):
        problems.append("_SubprocessScriptLauncher._call_children_scripts")
    if not callable(getattr(_ChildProcessObserver, "_run", None)):
        problems.append("_ChildProcessObserver._run")
    if not callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None)):
        problems.append("_TrainingEpochLoop._broadcast_sigterm_tensor")
    connector = _SignalConnector(trainer=None)  # type: ignore[arg-type]
    if getattr(connector, "received_sigterm", None) is not False:
        problems.append("_SignalConnector.received_sigterm")
    return problems
