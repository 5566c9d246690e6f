"""A rank ends when its launcher does: the parent-death signal, or a thread watching the launcher's pid.

A rank started by a launcher that then dies (killed, SIGKILL: no handler runs) would train on alone,
holding its device and its collectives' peers. :class:`~lightning_parallel.distributed.stop.StopGuard`
asks the kernel to signal the rank when its parent dies (``PR_SET_PDEATHSIG``, where the launcher is
the parent: spawn, fork, the script launcher) and otherwise watches the launcher's pid (a forkserver's
ranks, whose parent is the server); either way the rank takes the same path as a stop sent to it.

Pure Python and PyTorch-free; Linux gives the parent-death signal and process file descriptors,
elsewhere the pid is polled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from collections.abc import Callable

from lightning_parallel._pids import pid_alive

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``signum`` to this process when ``parent`` (its parent now) dies (Linux).

    Returns False where ``PR_SET_PDEATHSIG`` is unavailable or ``parent`` is not the parent. A parent
    that died before the call (the signal would never come) is caught by the check after it.

    Example::

        die_with_parent(os.getppid())      # in a worker, first thing
    """
    if not sys.platform.startswith("linux") or os.getppid() != parent:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (AttributeError, OSError):
        return False
    if os.getppid() != parent:  # died meanwhile: this process was re-parented and no signal will come
        os.kill(os.getpid(), signum)
    return True


def clear_parent_death_signal() -> None:
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)


def launcher_watch(pid: int) -> Callable[[], bool]:
    """A call that waits up to half a second and says whether ``pid`` is still alive.

    A process file descriptor (Linux >= 5.3) follows that very process, whatever reuses its pid later;
    elsewhere the pid is polled.
    """
    try:
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return lambda: not poller.poll(500)

    def poll_pid() -> bool:
        time.sleep(0.5)
        return pid_alive(pid)

    return poll_pid
