"""The disk tier's scratch: one directory per rank under the user's, locked while in use, and its files.

The optimizer state written there is scratch, never a checkpoint: checkpoints hold the state (the
optimizer's ``state_dict()`` reads it from the files), and a run starts its files afresh.

* :class:`ScratchDir` - ``<offload_dir>/rank<R>`` (ranks of a node never share one), held with an
  exclusive ``flock`` on its ``lock`` file for as long as an optimizer uses it, removed with its files
  when the last one closes (or at the interpreter's exit). A directory left by a killed run has no
  holder: it is emptied and reused (the state then comes from the checkpoint the job resumes from);
  one held by a live process (another job given the same directory) is refused.
* :class:`StateFile` - one file of fixed size, its blocks reserved when it is made (``posix_fallocate``:
  a disk without room fails there, before any step, not in the middle of one), read and written at
  offsets from any thread (``pread``/``pwrite`` release the GIL). Where Linux allows it the file has no
  name (``O_TMPFILE``): the kernel frees it when the process ends, even by SIGKILL.
* :func:`checked_directory`, :func:`check_room` - the checks before any step, with the values and the fix.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import shutil
import socket
import tempfile
from typing import ClassVar

import torch

from lightning_parallel._table import format_bytes
from lightning_parallel.io.tempfiles import open_unnamed

_LOCK = "lock"
_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """The disk under the offload directory filled (or its quota ran out) while the state was written."""


def checked_directory(path: str) -> str:
    """``path`` as an absolute directory this process can write files in.

    Raises:
        ValueError: it does not exist, is not a directory, or is not writable; with the fix.

    Example::

        root = checked_directory("/local_nvme/offload")
    """
    fix = "name an existing, writable directory on a local disk (NVMe) as offload_dir"
    if not os.path.exists(path):
        raise ValueError(f"offload_dir {path!r} does not exist: create it, or {fix}")
    if not os.path.isdir(path):
        raise ValueError(f"offload_dir {path!r} is not a directory: {fix}")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(f"offload_dir {path!r} is not writable ({err.strerror}): {fix}") from err
    return os.path.abspath(path)


def check_room(path: str, needed: int) -> None:
    """Raise unless the disk holding ``path`` has ``needed`` bytes free.

    Raises:
        ValueError: with the bytes needed and free, and the fix.

    Example::

        check_room("/local_nvme/offload/rank0", 12 * 2**30)
    """
    free = shutil.disk_usage(path).free
    if needed > free:
        raise ValueError(
            f"the optimizer state needs {format_bytes(needed)} ({needed} bytes) of disk under offload_dir "
            f"{path!r} but its disk has {format_bytes(free)} ({free} bytes) free: free room there, name a "
            f"directory on a larger disk, or offload to the host"
        )


class ScratchDir:
    """This process's scratch directory for rank ``rank`` under ``root``: made (or taken over from a
    killed run) by :meth:`acquire`, removed by the last :meth:`release`.

    Example::

        scratch = ScratchDir.acquire("/local_nvme/offload", rank=3)   # /local_nvme/offload/rank3
        state = scratch.new_file(2**30)
        ...
        state.close()
        scratch.release()
    """

    _held: ClassVar[dict[str, ScratchDir]] = {}  # path -> the instance this process holds

    def __init__(self, path: str, lock_fd: int, stale: list[str]) -> None:
        self.path = path
        self.stale = stale  # what a killed run had left (removed)
        self._lock_fd = lock_fd
        self._users = 0

    @classmethod
    def acquire(cls, root: str, rank: int) -> ScratchDir:
        """The rank's directory, held by this process (one more user if it holds it already).

        Raises:
            ValueError: ``root`` is unusable (:func:`checked_directory`), or a live process holds the
                rank's directory.
        """
        path = os.path.join(checked_directory(root), f"rank{rank}")
        held = cls._held.get(path)
        if held is None:
            held = cls._held[path] = cls(path, *_take(path))
        held._users += 1
        return held

    def new_file(self, nbytes: int, unnamed: bool | None = None) -> StateFile:
        """A file of ``nbytes`` reserved bytes here (``unnamed=None``: unnamed where possible)."""
        return StateFile(self.path, nbytes, unnamed)

    def release(self) -> None:
        """One user less; the last one removes the directory and its files and drops the lock."""
        self._users -= 1
        if self._users > 0:
            return
        self._held.pop(self.path, None)
        for name in os.listdir(self.path):
            if name != _LOCK:
                _remove(os.path.join(self.path, name))
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.path, _LOCK))
            os.rmdir(self.path)
        os.close(self._lock_fd)  # (closing drops the lock)


def _take(path: str) -> tuple[int, list[str]]:
    """Lock ``path`` (made if missing), empty what a dead holder left: (the lock's fd, what was removed)."""
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        # A POSIX record lock: held by this process only (a forked DataLoader worker does not inherit
        # it), dropped by the kernel when the process ends, however it ends; honoured over NFS.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            os.close(fd)
            raise
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ValueError(
            f"the offload scratch directory {path!r} is in use by {owner}: give each job its own "
            f"offload_dir (the ranks of one job get a directory each under it)"
        ) from None
    stale = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n != _LOCK]
    for leftover in stale:
        _remove(leftover)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd, stale


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@atexit.register
def _release_all() -> None:
    """At the interpreter's exit, the scratch this process still holds goes (files and directory)."""
    for scratch in list(ScratchDir._held.values()):
        scratch._users = 1
        scratch.release()


class StateFile:
    """A file of ``nbytes`` reserved bytes in ``directory``, read and written at offsets.

    Example::

        f = StateFile("/local_nvme/offload/rank0", 4096)
        f.write_from(0, torch.ones(1024))
        back = torch.empty(1024)
        f.read_into(0, back)
    """

    def __init__(self, directory: str, nbytes: int, unnamed: bool | None = None) -> None:
        self.directory, self.nbytes, self.name = directory, nbytes, None
        self.fd = _open_unnamed(directory) if unnamed is not False else None
        if self.fd is None:
            if unnamed:
                raise ValueError(f"the filesystem of {directory!r} has no unnamed files (O_TMPFILE)")
            handle, self.name = tempfile.mkstemp(prefix="optimizer-", suffix=".state", dir=directory)
            self.fd = handle
        try:
            if nbytes and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, nbytes)
            elif nbytes:  # (macOS: no reservation; a full disk then shows in a step, as DiskFullError)
                os.ftruncate(self.fd, nbytes)
        except OSError as err:
            self.close()
            if err.errno in _FULL:
                check_room(directory, nbytes)  # the message with the numbers, if the check sees it
            raise ValueError(
                f"could not reserve {format_bytes(nbytes)} for the optimizer state under {directory!r} "
                f"({err.strerror}): free room there, or name a directory on another disk as offload_dir"
            ) from err

    def read_into(self, offset: int, buffer: torch.Tensor) -> None:
        """Fill ``buffer`` (a contiguous host tensor) from the file at byte ``offset``."""
        view = _bytes(buffer)
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(errno.EIO, f"the offload file under {self.directory!r} ended early")
            done += got

    def write_from(self, offset: int, buffer: torch.Tensor) -> None:
        """Write ``buffer`` (a contiguous host tensor) into the file at byte ``offset``.

        Raises:
            DiskFullError: the disk (or the quota) is full, with the fix.
            OSError: another write failure, naming the directory.
        """
        view = _bytes(buffer)
        done = 0
        try:
            while done < len(view):
                done += os.pwritev(self.fd, [view[done:]], offset + done)
        except OSError as err:
            if err.errno in _FULL:
                raise DiskFullError(
                    err.errno,
                    f"the disk under offload_dir {self.directory!r} filled while the optimizer state was "
                    f"written ({err.strerror}; {len(view) - done} bytes left to write at byte "
                    f"{offset + done} of a file of {self.nbytes} bytes): free room on it or name another "
                    f"disk; the files there are scratch, resume from the last checkpoint",
                ) from err
            message = f"writing the optimizer state under {self.directory!r}: {err.strerror}"
            raise OSError(err.errno, message) from err

    def close(self) -> None:
        """Close (an unnamed file is then freed) and remove the file; twice is harmless."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.name is not None:
            _remove(self.name)
            self.name = None


def _open_unnamed(directory: str) -> int | None:
    try:
        return open_unnamed(directory)
    except (OSError, AttributeError):  # no O_TMPFILE here (the filesystem, the kernel, the platform)
        return None


def _bytes(buffer: torch.Tensor) -> memoryview:
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("the offload files read and write contiguous host tensors only")
    return memoryview(buffer.reshape(-1).view(torch.uint8).numpy()).cast("B")
