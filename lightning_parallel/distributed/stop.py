"""A stop is a stop: a process told to stop (SIGTERM, SIGINT), or left by its launcher, ends in bounded time.

This module holds what a stop is (its signals, the grace period, the exit status it leaves) and a
rank's side of it:

* **a rank** runs a :class:`StopGuard`. Python runs signal handlers in the main thread only, between
  bytecodes, so a rank blocked in a collective (a C++ wait) never runs one. The guard sees the signal
  anyway: ``signal.set_wakeup_fd`` makes the C-level handler write the signal's number to a socket that
  a daemon thread reads. From that moment the process has ``grace`` seconds to stop by itself (the
  Python handler's orderly stop, e.g. Lightning's); then the thread ends it with ``os._exit(128 +
  signal)``, the status a shell gives a process a signal ended. The guard also makes the rank die with
  its launcher (``launcher_death.py``: ``PR_SET_PDEATHSIG`` where the launcher is the parent, a watch
  thread otherwise);
* **the launcher** of spawned or forked ranks runs ``stop_forwarding.py``'s ``forwarding_stop_signals``:
  a stop signal is passed to every rank, the ranks get ``grace`` seconds (plus a margin for their own
  exit), the ones still alive are killed, and the launcher ends with the signal's status.

Pure Python and PyTorch-free (no Lightning import).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_parallel.distributed.launcher_death import (
    clear_parent_death_signal,
    die_with_parent,
    launcher_watch,
)

__all__ = [
    "DEFAULT_GRACE",
    "LAUNCHER_PID_ENV",
    "STOP_SIGNALS",
    "StopGuard",
    "check_grace",
    "current_guard",
    "exit_status",
    "stop_received",
    "stopped_status",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_GRACE = 30.0
"""Seconds a process has, after a stop signal, to stop by itself before it is ended."""

LAUNCHER_PID_ENV = "LIGHTNING_PARALLEL_LAUNCHER_PID"
"""Set in a rank's environment by the launcher that started it: the pid the rank dies with."""

_guard: StopGuard | None = None
_received: int | None = None  # the first stop signal a guard of this process noted (it stays)


def exit_status(signum: int) -> int:
    """The exit status of a process that a signal stopped: ``128 + signum``, as shells report it (143).

    Example::

        exit_status(signal.SIGTERM)   # 143
    """
    return 128 + int(signum)


def stopped_status(exit_code: int | None) -> int | None:
    """The job's exit status if a process that exited with ``exit_code`` was stopped, else None.

    128 + SIGTERM/SIGINT (a stop that ran its course), or minus the signal (killed by it), as
    ``multiprocessing`` reports a child's exit.

    Example::

        stopped_status(-15)   # 143
        stopped_status(1)     # None
    """
    if exit_code is None:
        return None
    codes = {exit_status(s): exit_status(s) for s in STOP_SIGNALS}
    codes.update({-int(s): exit_status(s) for s in STOP_SIGNALS})
    return codes.get(exit_code)


def check_grace(grace: float | timedelta, owner: str) -> float:
    """``grace`` in seconds, or a clear error for anything that is not a positive, finite duration.

    Example::

        check_grace(timedelta(seconds=30), "PipelineStrategy(stop_grace_period=...)")   # 30.0
    """
    seconds = grace.total_seconds() if isinstance(grace, timedelta) else grace
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"{owner}: the grace period must be seconds or a timedelta, got {grace!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{owner}: the grace period must be positive and finite (e.g. 30.0), got {grace!r}")
    return float(seconds)


def current_guard() -> StopGuard | None:
    """The guard started in this process, if any (one per process)."""
    return _guard


def stop_received() -> int | None:
    """The stop signal this process was told to stop by (a guard noted it, also one stopped since), or None.

    Example::

        if stop_received() is None:       # a rank that ended is a failure, not part of a stop
            end_the_job()
    """
    return _received


class StopGuard:
    """One process's bound on stopping: ``grace`` seconds after a stop signal it is gone, blocked or not.

    Start it in the main thread of every rank; stop it when the work is over. Once a stop signal came,
    the deadline stays armed even after :meth:`stop`: a process told to stop ends.

    Args:
        grace: seconds between the first stop signal and the hard exit.
        name: who this is in messages (``"rank 1"``).
        launcher: the pid of the process that started this one: the guard ends this process (SIGTERM to
            itself, then ``grace``) when it dies.
        on_hard_exit: called just before the hard exit (e.g. to kill the processes this one started).

    Example::

        guard = StopGuard(grace=30.0, name="rank 1", launcher=os.getppid())
        guard.start()
        try:
            train()
        finally:
            guard.stop()
    """

    def __init__(
        self,
        grace: float = DEFAULT_GRACE,
        name: str = "this process",
        launcher: int | None = None,
        on_hard_exit: Callable[[], Any] | None = None,
    ) -> None:
        self.grace = check_grace(grace, "StopGuard")
        self.name, self.launcher, self.on_hard_exit = name, launcher, on_hard_exit
        self.signum: int | None = None  # the first stop signal received
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._parent_signal = False
        self._threads: list[threading.Thread] = []

    @property
    def exit_code(self) -> int | None:
        """``128 + signal`` once a stop signal came (the status this process should end with), else None."""
        return None if self.signum is None else exit_status(self.signum)

    def start(self) -> StopGuard:
        """Watch for stop signals (and the launcher's death). Call in the main thread; returns self.

        Raises:
            RuntimeError: not in the main thread (``signal.set_wakeup_fd`` is main-thread only).
        """
        global _guard
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopGuard.start() must run in the main thread")
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)
        self._spawn(self._watch_signals, "signals")
        if self.launcher is not None:
            self._parent_signal = die_with_parent(self.launcher)
            if not self._parent_signal:
                self._spawn(self._watch_launcher, "launcher")
        _guard = self
        return self

    def stop(self) -> None:
        """Stop watching (a deadline already armed by a stop signal stays). Safe to call twice."""
        global _guard
        if self._sockets is None:
            return
        self._done.set()
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_fd)
        if self._parent_signal:
            clear_parent_death_signal()
        writer = self._sockets[1]
        with contextlib.suppress(OSError):
            writer.send(b"\0")  # wakes the signal thread, which then closes the sockets
        self._sockets = None
        if _guard is self:
            _guard = None

    def note(self, signum: int) -> None:
        """A stop signal arrived (the wakeup socket, or a handler that saw it first): arm the deadline."""
        global _received
        with self._lock:
            if self.signum is not None:
                return
            self.signum = int(signum)
            if _received is None:
                _received = self.signum
        self._spawn(self._deadline, "deadline", keep=True)

    # --------------------------------------------------------------------------------- threads
    def _spawn(self, target: Callable[[], None], what: str, keep: bool = False) -> None:
        thread = threading.Thread(target=target, name=f"lightning_parallel-stop-{what}", daemon=True)
        thread.start()
        if not keep:
            self._threads.append(thread)

    def _watch_signals(self) -> None:
        assert self._sockets is not None
        reader, writer = self._sockets
        try:
            while not self._done.is_set():
                data = reader.recv(64)
                if not data:
                    return
                for signum in data:
                    if signum in STOP_SIGNALS:
                        self.note(signum)
        finally:
            reader.close()
            writer.close()

    def _watch_launcher(self) -> None:
        assert self.launcher is not None
        alive = launcher_watch(self.launcher)
        while not self._done.wait(0.0):
            if not alive():
                if not self._done.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)  # the same path as a stop sent to this process
                return

    def _deadline(self) -> None:
        end = time.monotonic() + self.grace
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
        assert self.signum is not None
        code = exit_status(self.signum)
        _say(
            f"{self.name}: still running {self.grace:g} s after {signal.Signals(self.signum).name} "
            f"({_where_main_thread_is()}): exits with code {code}"
        )
        if self.on_hard_exit is not None:
            try:
                self.on_hard_exit()
            except Exception as err:
                _say(f"{self.name}: on_hard_exit failed: {type(err).__name__}: {err}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _where_main_thread_is() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "main thread gone"
    code = frame.f_code
    return f"main thread at {os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def _say(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except Exception:
        with contextlib.suppress(OSError):
            os.write(2, (text + "\n").encode())
