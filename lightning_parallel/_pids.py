"""Whether a process is alive, by its pid: the one check the stop guard and the temp-file cleanup share."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0; one owned by another user counts as alive).

    Example::

        >>> pid_alive(os.getpid())
        True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
