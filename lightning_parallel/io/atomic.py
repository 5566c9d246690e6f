"""Crash-safe checkpoint files: a temp file in the same directory, fsync, link or rename, fsync the directory.

A checkpoint is written by ``torch.save`` straight into a temporary file in its destination's
directory (streamed, never serialised into memory first) while a SHA-256 of the bytes is computed
on the way. Where Linux ``O_TMPFILE`` works, that file has no name until it is complete (see
:mod:`lightning_parallel.io.tempfiles`), so a killed write leaves nothing behind;
:func:`temp_file_method` says which kind a directory gets.
The digest and a little metadata go into the zip archive's end-of-central-directory *comment*
(:mod:`lightning_parallel.io.zip_tag`, whose reading and verifying functions this module's namespace
offers too), so the file stays an ordinary ``torch.load``-able checkpoint and carries its own integrity
check: no sidecar file that could disagree with it after a crash. The file is then fsynced, renamed over the
destination (atomic on POSIX within one filesystem) and the directory is fsynced, so at any instant
of a SIGKILL the destination holds either the complete old file or the complete new one.

Named temporary files are ``.<name>.<host>-<pid>-<token>.partial``; :func:`remove_orphans` deletes
the ones left by a killed process at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import torch

from lightning_parallel.io import tempfiles
from lightning_parallel.io.tempfiles import temp_file_method, temp_path_for
from lightning_parallel.io.zip_tag import (
    FORMAT,
    CheckpointVerification,
    _HashingWriter,
    append_tag,
    list_tagged_checkpoints,
    newest_first,
    read_tag,
    verify_checkpoint,
)

__all__ = [
    "FORMAT",
    "CheckpointFileError",
    "CheckpointVerification",
    "DiskFullError",
    "atomic_symlink",
    "atomic_write",
    "check_writable_dir",
    "created_for_now",
    "fsync_dir",
    "list_tagged_checkpoints",
    "newest_first",
    "read_tag",
    "remove_file",
    "remove_orphans",
    "save_checkpoint_file",
    "temp_file_method",
    "temp_path_for",
    "verify_checkpoint",
]


class CheckpointFileError(RuntimeError):
    """Writing a checkpoint file failed; the message names the file and the cause."""


class DiskFullError(CheckpointFileError):
    """The filesystem filled up during a checkpoint write; the message gives the bytes needed and free."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_COPY_CHUNK = 8 << 20


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink inside ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (e.g. certain network mounts) refuse fsync on directories
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[BinaryIO], Any], needed: Callable[[], int] | None = None) -> Any:
    """Call ``write(file)`` on a temp file beside ``path``; fsync, put it in place, fsync the directory.

    The temp file is unnamed (``O_TMPFILE``) where :func:`temp_file_method` says so, else named
    and renamed over ``path``. Returns what ``write`` returns. On any error no temp file is left and
    the error is re-raised with the destination in its message; ``path`` is left as it was. A full
    disk (``ENOSPC``, ``EDQUOT``) is a :class:`DiskFullError` giving ``needed()`` bytes and the free ones.
    """
    directory = os.path.dirname(os.path.abspath(path))
    method = tempfiles.link_method(directory)
    try:
        result = _write_named(path, write) if method is None else _write_unnamed(path, write, method)
    except Exception as err:
        if _disk_full(err):  # the temp file is gone by now: the free space is what the write could use
            raise DiskFullError(_disk_full_message(path, needed() if needed else None)) from err
        message = f"could not write checkpoint {path!r}: {type(err).__name__}: {err}"
        raise CheckpointFileError(message) from err
    fsync_dir(directory)
    return result


def _disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` or an error it was raised from or during is ENOSPC/EDQUOT (torch hides it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno in _DISK_FULL:
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _disk_full_message(path: str, needed: int | None) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{_size(shutil.disk_usage(directory).free)} free"
    except OSError:
        free = "an unknown amount free"
    need = f"needs at least {_size(needed)}" if needed else "did not fit"
    return (
        f"could not write checkpoint {path!r}: the disk is full (no space left on device): the checkpoint "
        f"{need} and {directory!r} has {free}. No temporary file is left and the checkpoints written "
        "before are intact: free space there, or write checkpoints to a larger disk"
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**20:.1f} MiB)"


def _write_unnamed(path: str, write: Callable[[BinaryIO], Any], method: Any) -> Any:
    # A failure or a kill before the link leaves no name to clean up: the kernel frees the inode.
    with os.fdopen(tempfiles.open_unnamed(os.path.dirname(os.path.abspath(path))), "r+b") as f:
        result = write(f)
        f.flush()
        os.fsync(f.fileno())
        tempfiles.link_into_place(f.fileno(), path, method)
    return result


def _write_named(path: str, write: Callable[[BinaryIO], Any]) -> Any:
    tmp = temp_path_for(path)
    try:
        with open(tmp, "x+b") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return result


def save_checkpoint_file(obj: Any, path: str, meta: dict[str, Any] | None = None) -> str:
    """Stream ``obj`` with ``torch.save`` into ``path`` atomically and durably; return its SHA-256.

    Peak extra memory is one tensor's CPU copy at most (for device tensors), not the checkpoint.

    Example::

        digest = save_checkpoint_file({"w": torch.zeros(3)}, "ckpt/last.ckpt", {"step": 10})
        assert verify_checkpoint("ckpt/last.ckpt").ok
    """

    written = [0]

    def write(f: BinaryIO) -> str:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except Exception as err:
            if writer.error is not None:
                raise writer.error from err  # the OS's error, not torch's "unexpected pos"
            raise
        finally:
            written[0] = writer.size
        digest = writer.sha.hexdigest()
        append_tag(f, writer.size, {"format": FORMAT, "sha256": digest, **(meta or {})})
        return digest

    return atomic_write(path, write, needed=lambda: max(written[0], _tensor_bytes(obj)))


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a nested checkpoint dict (each storage once): a save needs that much."""
    storages: dict[tuple[str, int], int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor) and item.device.type != "meta":
            storage = item.untyped_storage()
            storages[(str(item.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return sum(storages.values())


def remove_orphans(directory: str) -> list[str]:
    """Delete named temporary files left in ``directory`` by killed writers; return their paths.

    A temp file of a process still alive on this host is kept (it may be writing right now).
    """
    removed = tempfiles.remove_orphans(directory)
    if removed:
        fsync_dir(directory)
    return removed


def remove_file(path: str) -> None:
    """Unlink ``path`` (if present) and make the unlink durable."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_symlink(target: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``target`` (relative link) with one rename: never a moment without a link.

    As in Lightning's ``ModelCheckpoint._link_checkpoint``, a directory at ``linkpath`` is removed
    first, and where no symbolic link can be made the file is copied instead (atomically).
    """
    directory = os.path.dirname(os.path.abspath(linkpath))
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)
    tmp = temp_path_for(linkpath)
    try:
        os.symlink(os.path.relpath(target, directory), tmp)
    except OSError:
        with open(target, "rb") as src:
            atomic_write(linkpath, lambda f: shutil.copyfileobj(src, f, _COPY_CHUNK))
        return
    try:
        os.replace(tmp, linkpath)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def check_writable_dir(directory: str) -> str | None:
    """Create ``directory`` if needed and prove a file can be written there; return the problem or None."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = temp_path_for(os.path.join(directory, "probe"))
        with open(probe, "xb") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def created_for_now(directory: str) -> Iterator[None]:
    """Remove, on exit, the directories up to ``directory`` that did not exist on entry and are still empty.

    Checks that need the directory (is it writable, which temp files does its filesystem allow) then
    leave nothing behind: as Lightning's ModelCheckpoint, a run that saves nothing creates no directory.

    Example::

        with created_for_now("checkpoints"):
            problem = check_writable_dir("checkpoints")
    """
    missing = []
    path = os.path.abspath(directory)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)  # deepest first
        path = os.path.dirname(path)
    try:
        yield
    finally:
        for path in missing:
            with contextlib.suppress(OSError):  # not empty (a file was written), or gone already
                os.rmdir(path)
