"""Crash-safe checkpoint directories: written under a temporary sibling name, published with one rename.

Every rank writes its files into ``.<name>.<host>-<pid>-<token>.partial`` beside the destination; once
all have finished, each rank hashes the files it wrote (in parallel), global rank 0 writes a manifest
(file -> size, SHA-256) and ``meta.pt`` (tagged with its own hash and the manifest's, as
:func:`~lightning_parallel.io.atomic.save_checkpoint_file` tags files), then renames the directory into
place: on Linux one ``renameat2(RENAME_EXCHANGE)`` swaps it with a previous directory of the same name,
so the name always holds a complete directory. A failure on any rank is raised on every rank and the
temporary directory is removed; a killed job leaves only a ``.partial`` directory, which
:func:`lightning_parallel.io.atomic.remove_orphans` deletes at the next start.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_parallel.distributed.agree import agree, decide_on, distributed_ready
from lightning_parallel.distributed.collectives import all_gather_objects, broadcast_object
from lightning_parallel.io import atomic, zip_tag
from lightning_parallel.io.tempfiles import temp_path_for

__all__ = [
    "META_NAME",
    "abandon_checkpoint_dir",
    "begin_checkpoint_dir",
    "finish_checkpoint_dir",
    "is_checkpoint_dir",
    "list_tagged_dirs",
    "remove_dir",
    "verify_checkpoint_dir",
    "write_checkpoint_dir",
]

META_NAME = "meta.pt"  # as Lightning's ModelParallelStrategy names the file beside the shards
MANIFEST_NAME = "manifest.json"
_DCP_METADATA = ".metadata"
_CHUNK = 8 << 20


def _rank() -> int:
    return dist.get_rank() if distributed_ready() else 0


def write_checkpoint_dir(
    path: str,
    write_shards: Callable[[str], None],
    meta: dict[str, Any],
    tag: dict[str, Any] | None = None,
    group: Any | None = None,
) -> None:
    """Write a checkpoint directory at ``path`` atomically: call it on every rank (of ``group``).

    ``write_shards(tmp_dir)`` runs on every rank (``torch.distributed.checkpoint.save`` into it);
    ``meta`` (global rank 0's) is saved as ``meta.pt``, tagged with ``tag`` (step, epoch, ...).
    ``group`` (every rank of the job, default the default group) carries the collectives.

    Raises:
        Exception: on every rank, the first failing rank's error; ``path`` is left as it was.

    Example::

        write_checkpoint_dir("ckpt/step=10.ckpt", lambda d: dcp.save(state, checkpoint_id=d), {"epoch": 0})
    """
    tmp = begin_checkpoint_dir(path, group)
    try:
        write_shards(tmp)  # torch.distributed.checkpoint raises on every rank if one fails
        finish_checkpoint_dir(tmp, path, meta, tag, group)
    except BaseException:
        abandon_checkpoint_dir(tmp)
        raise


def begin_checkpoint_dir(path: str, group: Any | None = None) -> str:
    """Every rank: the temporary directory (made by rank 0) that the shards of ``path`` go into.

    Example::

        tmp = begin_checkpoint_dir("ckpt/step=10.ckpt")   # ".../ckpt/.step=10.ckpt.host-42-1a2b3c4d.partial"
    """
    path = os.path.abspath(path)
    tmp = broadcast_object(temp_path_for(path) if _rank() == 0 else None, group=group)
    decide_on(0, lambda: os.makedirs(tmp), group=group)
    return tmp


def finish_checkpoint_dir(
    tmp: str, path: str, meta: dict[str, Any], tag: dict[str, Any] | None = None, group: Any | None = None
) -> None:
    """Every rank, once its shards are in ``tmp``: hash them, and rank 0 publishes ``tmp`` as ``path``.

    Raises:
        Exception: on every rank, the first failing rank's error (``tmp`` is then left to the caller).
    """
    error, mine = None, {}
    try:
        mine = hash_files(tmp, [n for n in os.listdir(tmp) if n.startswith(f"__{_rank()}_")])
    except Exception as err:
        error = err
    agree(error, group)
    files = {k: v for part in all_gather_objects(mine, group) for k, v in part.items()}
    path = os.path.abspath(path)
    decide_on(0, lambda: _finish_and_publish(tmp, path, files, meta, tag or {}), group=group)


def abandon_checkpoint_dir(tmp: str) -> None:
    """After a failed write: rank 0 removes the temporary directory (the published one is untouched)."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def hash_files(directory: str, names: list[str]) -> dict[str, list]:
    """``{name: [size, sha256]}`` of the named files of ``directory``."""
    out = {}
    for name in names:
        sha, size = hashlib.sha256(), 0
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
        out[name] = [size, sha.hexdigest()]
    return out


def _finish_and_publish(tmp: str, path: str, files: dict, meta: dict, tag: dict) -> None:
    files.update(hash_files(tmp, [_DCP_METADATA]))
    manifest = json.dumps(dict(sorted(files.items())), indent=0).encode()
    with open(os.path.join(tmp, MANIFEST_NAME), "wb") as f:
        f.write(manifest)
        f.flush()
        os.fsync(f.fileno())
    tag = {**tag, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}
    atomic.save_checkpoint_file(meta, os.path.join(tmp, META_NAME), tag)
    atomic.fsync_dir(tmp)
    publish_dir(tmp, path)


def publish_dir(tmp: str, path: str) -> None:
    """Move the complete directory ``tmp`` to ``path``, replacing what is there, never leaving it empty."""
    if os.path.lexists(path) and _exchange(tmp, path):
        _remove_tree_or_file(tmp)  # now the previous checkpoint
    else:
        if os.path.lexists(path):  # no renameat2: a short moment without ``path``, never a partial one
            old = temp_path_for(path)
            os.rename(path, old)
            os.rename(tmp, path)
            _remove_tree_or_file(old)
        else:
            os.rename(tmp, path)
    atomic.fsync_dir(os.path.dirname(path))


def _exchange(a: str, b: str) -> bool:
    """Swap two names in one ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15, glibc >= 2.28)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove_tree_or_file(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_dir(path: str) -> None:
    """Remove a checkpoint directory: renamed away first (one step), then deleted, so no half one stays.

    Example::

        remove_dir("ckpt/epoch=0-step=10.ckpt")
    """
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        atomic.remove_file(path)
        return
    doomed = temp_path_for(path)
    os.rename(path, doomed)
    atomic.fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(doomed, ignore_errors=True)


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` is a directory written by :func:`write_checkpoint_dir` (meta.pt and ``.metadata``)."""
    return os.path.isfile(os.path.join(path, META_NAME)) and os.path.isfile(os.path.join(path, _DCP_METADATA))


def list_tagged_dirs(directory: str, suffix: str = ".ckpt") -> list[tuple[str, dict[str, Any]]]:
    """Every ``*suffix`` checkpoint directory in ``directory`` whose meta.pt carries our tag, with the tag."""

    def meta_of(path: str) -> str | None:
        ours = not os.path.islink(path) and is_checkpoint_dir(path)
        return os.path.join(path, META_NAME) if ours else None

    return zip_tag.list_tagged(directory, suffix, meta_of)


def verify_checkpoint_dir(path: str, rank: int = 0, world: int = 1) -> atomic.CheckpointVerification:
    """Check a checkpoint directory: meta.pt's hash, the manifest's, and every file's size and hash.

    With ``rank``/``world`` only every ``world``-th file from ``rank`` on is hashed (the ranks share the
    reading); meta.pt and the manifest are checked on every rank.

    Example::

        result = verify_checkpoint_dir("ckpt/last.ckpt")
        if not result.ok:
            print(result.describe())
    """
    meta = atomic.verify_checkpoint(os.path.join(path, META_NAME))
    if not meta.ok:
        return atomic.CheckpointVerification(
            path, meta.status, meta.expected, meta.actual, meta.tag, meta.reason
        )
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            manifest_bytes = f.read()
        actual = hashlib.sha256(manifest_bytes).hexdigest()
        if actual != meta.tag.get("manifest_sha256"):
            return atomic.CheckpointVerification(
                path, "mismatch", meta.tag.get("manifest_sha256"), actual, meta.tag, MANIFEST_NAME
            )
        manifest = json.loads(manifest_bytes)
        names = sorted(manifest)[rank::world]
        for name, found in hash_files(path, names).items():
            if found != manifest[name]:
                expected = f"{name}: {manifest[name][0]} bytes, sha256 {manifest[name][1]}"
                actual = f"{found[0]} bytes, sha256 {found[1]}"
                return atomic.CheckpointVerification(path, "mismatch", expected, actual, meta.tag)
    except (OSError, ValueError) as err:
        return atomic.CheckpointVerification(path, "unreadable", tag=meta.tag, reason=str(err))
    return atomic.CheckpointVerification(path, "ok", meta.expected, meta.actual, meta.tag)
