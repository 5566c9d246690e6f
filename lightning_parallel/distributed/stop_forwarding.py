"""The launcher's side of a stop: a stop signal passed on to every rank it started, then the ranks' grace.

A launcher of spawned or forked ranks (``strategies/launcher.py``) that is told to stop (SIGTERM,
SIGINT) would otherwise end alone, or wait forever on ranks blocked in a collective. Under
:func:`forwarding_stop_signals` the signal goes to every rank, the ranks get the grace period (plus a
margin for their own exit), the ones still alive are killed, and the launcher ends with the signal's
status. Each rank's own bound is its :class:`~lightning_parallel.distributed.stop.StopGuard`.

Pure Python and PyTorch-free.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from lightning_parallel.distributed.stop import DEFAULT_GRACE, STOP_SIGNALS, exit_status

_LAUNCHER_MARGIN = 2.0  # the launcher waits this much past ``grace``: a rank's own exit (and report) first


@contextlib.contextmanager
def forwarding_stop_signals(
    children: Callable[[], Sequence[multiprocessing.process.BaseProcess]], grace: float = DEFAULT_GRACE
) -> Iterator[None]:
    """In a launcher's main thread: a stop signal is passed to ``children()``, which then have ``grace`` s.

    On SIGTERM or SIGINT the signal goes to every live child; the handler waits for them to exit (up to
    ``grace`` plus a 2 s margin for their own hard exit), kills those still alive, and raises
    ``SystemExit(128 + signum)`` for SIGTERM, ``KeyboardInterrupt`` for SIGINT. The previous handlers
    come back on exit. Outside the main thread it does nothing.

    Example::

        with forwarding_stop_signals(lambda: processes, grace=30.0):
            join(processes)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if stopping:
            return  # one stop at a time
        stopping.append(signum)
        procs = [p for p in children() if p.is_alive()]
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                os.kill(p.pid, signum)  # type: ignore[arg-type]
        _wait_then_kill(procs, grace + _LAUNCHER_MARGIN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(exit_status(signum))

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _wait_then_kill(procs: Sequence[multiprocessing.process.BaseProcess], seconds: float) -> None:
    end = time.monotonic() + seconds
    live = [p for p in procs if _alive(p)]
    while live and (left := end - time.monotonic()) > 0:
        waiting = [p.sentinel for p in live if p.is_alive()]
        if waiting:
            multiprocessing.connection.wait(waiting, timeout=min(left, 0.5))
        else:
            time.sleep(min(left, 0.1))  # a forkserver's ranks outlive the server that reports on them
        live = [p for p in live if _alive(p)]
    for p in live:
        with contextlib.suppress(OSError, ValueError):
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(5)


def _alive(p: multiprocessing.process.BaseProcess) -> bool:
    """Whether ``p`` still runs; also a forkserver's rank after its server died (no longer reported on)."""
    if p.is_alive():
        return True
    if p.pid is None:
        return False
    try:
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
