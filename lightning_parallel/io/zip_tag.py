"""The integrity tag of a checkpoint file: JSON in its zip archive's end-of-central-directory comment.

``torch.save`` writes a zip archive whose end record has an empty comment; :func:`append_tag` puts the
archive's SHA-256 and a little metadata there after the save (the bytes hashed are the archive as
written, its comment-length field zero), :func:`read_tag` finds it again from the end of the file, and
:func:`verify_checkpoint` recomputes the hash. The file stays an ordinary ``torch.load``-able
checkpoint. Written by :func:`lightning_parallel.io.atomic.save_checkpoint_file`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

__all__ = [
    "FORMAT",
    "CheckpointVerification",
    "append_tag",
    "list_tagged_checkpoints",
    "newest_first",
    "read_tag",
    "verify_checkpoint",
]

FORMAT = "lightning_parallel.rank0ckpt/1"
_EOCD_SIG = b"PK\x05\x06"
_EOCD_SIZE = 22
_MAX_COMMENT = 0xFFFF
_CHUNK = 8 << 20


class _HashingWriter:
    """A write-only file object that hashes what passes through it (``torch.save`` streams into it)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write as "unexpected pos"

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        try:
            self._f.write(view)
        except OSError as err:
            self.error = err
            raise
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def append_tag(f: BinaryIO, size: int, tag: dict[str, Any]) -> None:
    """Put ``tag`` (JSON) into the zip comment of the archive that ends at ``size`` in ``f``."""
    f.flush()
    f.seek(size - _EOCD_SIZE)
    eocd = f.read(_EOCD_SIZE)
    if eocd[:4] != _EOCD_SIG or eocd[-2:] != b"\x00\x00":
        raise RuntimeError("torch.save did not end the archive with an empty end-of-central-directory record")
    comment = json.dumps(tag, sort_keys=True).encode()
    if len(comment) > _MAX_COMMENT:
        raise ValueError(
            f"checkpoint tag is {len(comment)} bytes; the zip comment holds at most {_MAX_COMMENT}"
        )
    f.seek(size - 2)
    f.write(struct.pack("<H", len(comment)))
    f.seek(size)
    f.write(comment)


def read_tag(path: str) -> tuple[dict[str, Any] | None, int]:
    """Return (tag, payload_end) of a checkpoint: the JSON in its zip comment and where the comment starts.

    ``tag`` is None for a file without our tag (foreign, truncated, or not a zip archive).
    """
    size = os.path.getsize(path)
    tail_len = min(size, _EOCD_SIZE + _MAX_COMMENT)
    with open(path, "rb") as f:
        f.seek(size - tail_len)
        tail = f.read(tail_len)
    pos = tail.rfind(_EOCD_SIG)
    while pos >= 0:
        (comment_len,) = struct.unpack("<H", tail[pos + 20 : pos + 22]) if pos + 22 <= len(tail) else (-1,)
        if pos + _EOCD_SIZE + comment_len == len(tail):
            comment = tail[pos + _EOCD_SIZE :]
            return _parse_tag(comment), size - tail_len + pos + _EOCD_SIZE
        pos = tail.rfind(_EOCD_SIG, 0, pos)
    return None, size


def _parse_tag(comment: bytes) -> dict[str, Any] | None:
    try:
        tag = json.loads(comment.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return tag if isinstance(tag, dict) and tag.get("format") == FORMAT else None


@dataclass
class CheckpointVerification:
    """Outcome of :func:`verify_checkpoint`: ``status`` is "ok", "mismatch", "untagged" or "unreadable"."""

    path: str
    status: str
    expected: str | None = None
    actual: str | None = None
    tag: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        if self.status == "mismatch":
            return (
                f"checkpoint {self.path!r} is corrupt: SHA-256 hash mismatch "
                f"(expected {self.expected}, got {self.actual})"
            )
        if self.status == "unreadable":
            return f"checkpoint {self.path!r} cannot be read: {self.reason}"
        if self.status == "untagged":
            return f"checkpoint {self.path!r} carries no content hash ({self.reason})"
        return f"checkpoint {self.path!r} verifies (sha256 {self.actual})"


def verify_checkpoint(path: str) -> CheckpointVerification:
    """Recompute the content hash of a checkpoint written by :func:`save_checkpoint_file` and compare.

    Example::

        result = verify_checkpoint("ckpt/last.ckpt")
        if not result.ok:
            print(result.describe())
    """
    try:
        tag, payload_end = read_tag(path)
        if tag is None:
            with open(path, "rb") as f:
                looks_zip = f.read(2) == b"PK"
            reason = "zip archive without an end record: truncated?" if looks_zip else "no hash tag"
            return CheckpointVerification(path, "untagged", reason=reason)
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            remaining = payload_end - 2  # the comment-length field is hashed as written: zero
            while remaining > 0:
                chunk = f.read(min(_CHUNK, remaining))
                if not chunk:
                    break
                sha.update(chunk)
                remaining -= len(chunk)
        sha.update(b"\x00\x00")
    except OSError as err:
        return CheckpointVerification(path, "unreadable", reason=str(err))
    actual = sha.hexdigest()
    status = "ok" if actual == tag.get("sha256") else "mismatch"
    return CheckpointVerification(path, status, expected=tag.get("sha256"), actual=actual, tag=tag)


def list_tagged_checkpoints(directory: str, suffix: str = ".ckpt") -> list[tuple[str, dict[str, Any]]]:
    """Every ``*suffix`` file in ``directory`` that carries our tag, with the tag (hashes not checked)."""
    return list_tagged(directory, suffix, lambda path: path if os.path.isfile(path) else None)


def list_tagged(
    directory: str, suffix: str, tagged_file: Callable[[str], str | None]
) -> list[tuple[str, dict[str, Any]]]:
    """Every ``*suffix`` entry of ``directory`` (not hidden) whose ``tagged_file(path)`` carries our tag.

    ``tagged_file`` names the file holding an entry's tag (the entry itself, or a file inside it), or
    None for an entry that is not one of ours. Unreadable entries are skipped.

    Example::

        list_tagged("ckpts", ".ckpt", lambda p: p if os.path.isfile(p) else None)
    """
    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        holder = tagged_file(path) if name.endswith(suffix) and not name.startswith(".") else None
        if holder is None:
            continue
        with contextlib.suppress(OSError):
            tag, _ = read_tag(holder)
            if tag is not None:
                found.append((path, tag))
    return found


def newest_first(entries: Iterable[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Order tagged checkpoints newest first: by global step, then modification time."""

    def key(entry: tuple[str, dict[str, Any]]) -> tuple[int, float]:
        path, tag = entry
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            mtime = 0.0
        return int(tag.get("step", -1)), mtime

    return sorted(entries, key=key, reverse=True)
