"""Temporary files of a checkpoint write: unnamed (Linux ``O_TMPFILE``) where possible, named otherwise.

An ``O_TMPFILE`` file has no directory entry until it is linked: if the writer is killed first, the
kernel frees it and nothing is left behind. Giving it a name needs ``linkat`` through
``/proc/self/fd`` or with ``AT_EMPTY_PATH``; which of them works depends on the filesystem, the
kernel, the ``/proc`` mount and the process's capabilities, so each filesystem is probed once.
Elsewhere the write goes to a named temp file ``.<name>.<host>-<pid>-<token>.partial`` beside the
destination, which :func:`remove_orphans` deletes after a kill.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
from typing import Literal

from lightning_parallel._pids import pid_alive

__all__ = [
    "NAMED_TEMP_ENV",
    "link_into_place",
    "link_method",
    "open_unnamed",
    "remove_orphans",
    "temp_file_method",
    "temp_path_for",
]

NAMED_TEMP_ENV = "LIGHTNING_PARALLEL_NAMED_TEMP"
_PARTIAL_RE = re.compile(r"^\..+\.(?P<host>[^.]+)-(?P<pid>\d+)-[0-9a-f]{8}\.partial$")
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_LinkMethod = Literal["proc", "empty_path"]
_link_methods: dict[int, _LinkMethod | None] = {}  # st_dev -> what works there (probed once)


def _hostname() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def temp_path_for(path: str) -> str:
    """A fresh temporary name in ``path``'s directory that :func:`remove_orphans` recognises.

    Example::

        temp_path_for("ckpt/last.ckpt")  # ".../ckpt/.last.ckpt.myhost-4242-1f2e3d4c.partial"
    """
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{_hostname()}-{os.getpid()}-{secrets.token_hex(4)}.partial")


def temp_file_method(directory: str) -> Literal["O_TMPFILE", "named"]:
    """How a checkpoint write into ``directory`` keeps its bytes until they are complete.

    ``"O_TMPFILE"``: in an unnamed file, linked into place when complete (a killed write leaves
    nothing). ``"named"``: in a named temp file renamed into place (a killed write leaves a
    ``.partial`` file, removed at the next start). Setting the environment variable
    ``LIGHTNING_PARALLEL_NAMED_TEMP=1`` forces ``"named"``.

    Example::

        temp_file_method("checkpoints")  # "O_TMPFILE" on ext4, xfs, btrfs or tmpfs under Linux
    """
    return "O_TMPFILE" if link_method(directory) is not None else "named"


def link_method(directory: str) -> _LinkMethod | None:
    """How an unnamed file of ``directory`` can be linked (None: use a named temp file).

    Example::

        method = link_method("ckpt")  # "proc", "empty_path" or None
    """
    if os.environ.get(NAMED_TEMP_ENV) == "1" or not hasattr(os, "O_TMPFILE"):
        return None
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return None
    if device not in _link_methods:
        _link_methods[device] = _probe(directory)
    return _link_methods[device]


def _probe(directory: str) -> _LinkMethod | None:
    for method in ("proc", "empty_path"):
        probe = temp_path_for(os.path.join(directory, "probe"))
        try:
            fd = open_unnamed(directory)
        except OSError:
            return None  # the filesystem (or kernel) has no O_TMPFILE
        try:
            _link(fd, probe, method)
            os.remove(probe)
            return method
        except OSError:
            continue
        finally:
            os.close(fd)
    return None


def open_unnamed(directory: str) -> int:
    """A read-write file descriptor on a new unnamed file in ``directory`` (``O_TMPFILE``).

    Example::

        with os.fdopen(open_unnamed("ckpt"), "r+b") as f:
            f.write(data)
            link_into_place(f.fileno(), "ckpt/a.ckpt", link_method("ckpt"))
    """
    return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o666)


def _link(fd: int, dest: str, method: _LinkMethod) -> None:
    if method == "proc":
        os.link(f"/proc/self/fd/{fd}", dest)  # follows the magic link (AT_SYMLINK_FOLLOW)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(dest), _AT_EMPTY_PATH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dest)


def link_into_place(fd: int, path: str, method: _LinkMethod) -> None:
    """Give the complete unnamed file ``fd`` the name ``path``, replacing a file already there.

    A new name appears in one ``linkat``. An existing one is replaced by a rename from a
    temporary name, the only instant a kill can leave a ``.partial`` file. Should linking fail
    after all (the probe passed on another mount of the same filesystem), the bytes are copied
    into a named temp file instead and that filesystem is no longer linked into.

    Example::

        link_into_place(fd, "ckpt/last.ckpt", link_method("ckpt"))  # after writing and fsyncing fd
    """
    try:
        _link(fd, path, method)
        return
    except FileExistsError:
        pass
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EOPNOTSUPP):
            raise
        _link_methods[os.stat(os.path.dirname(os.path.abspath(path))).st_dev] = None
        _copy_into_place(fd, path)
        return
    tmp = temp_path_for(path)
    _link(fd, tmp, method)
    _replace(tmp, path)


def _copy_into_place(fd: int, path: str) -> None:
    tmp = temp_path_for(path)
    try:
        with open(tmp, "xb") as out, os.fdopen(os.dup(fd), "rb") as src:
            src.seek(0)
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _replace(tmp, path)


def _replace(tmp: str, path: str) -> None:
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def remove_orphans(directory: str) -> list[str]:
    """Delete named temporary files (and directories) left in ``directory`` by killed writers.

    Returns their paths.

    A temp file of a process still alive on this host is kept (it may be writing right now).

    Example::

        removed = remove_orphans("ckpt")
    """
    removed: list[str] = []
    if not os.path.isdir(directory):
        return removed
    host = _hostname()
    for name in os.listdir(directory):
        match = _PARTIAL_RE.match(name)
        if match is None:
            continue
        if match["host"] == host and pid_alive(int(match["pid"])):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            if os.path.isdir(path) and not os.path.islink(path):  # a distributed checkpoint's directory
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    return removed
