"""Checkpoint directories written in the background, on a process group of their own.

:func:`save_checkpoint_dir_async` is :func:`~lightning_parallel.checkpoint.directory.write_checkpoint_dir`
with the training loop waiting only for a CPU copy of this rank's state. It hands the state to
``torch.distributed.checkpoint.async_save`` with a :class:`BufferStager` (the copy goes into buffers
kept from the previous save: a memcpy, no page faults), which plans and writes the shards on a thread;
a second job on the :class:`~lightning_parallel.io.async_writer.AsyncWriter`'s thread then hashes them
and rank 0 publishes the directory. Every collective of the background runs on :func:`checkpoint_group`,
a gloo group made for checkpointing (torch's own advice for ``async_save``), so none of them ever pairs
with one of training's on the default group. One save in flight in the whole process
(:func:`background_writer`, whichever callback asked): every rank then runs the background
collectives in the order the saves were asked for, the same on every rank. A kill while a save is in
flight leaves only its ``.partial`` directory: the newest published one is intact.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from lightning_parallel.checkpoint.directory import (
    abandon_checkpoint_dir,
    begin_checkpoint_dir,
    finish_checkpoint_dir,
)
from lightning_parallel.distributed.agree import agree, distributed_ready
from lightning_parallel.io.async_writer import AsyncWriter, SnapshotBuffers, snapshot

__all__ = ["BufferStager", "background_writer", "checkpoint_group", "save_checkpoint_dir_async"]

_group: tuple[Any, Any] | None = None  # (the default group it was made under, the checkpoint group)
_writer: AsyncWriter | None = None


def background_writer() -> AsyncWriter:
    """The one writer of this process's background directory saves (two in flight could interleave).

    Example::

        error = background_writer().wait()
    """
    global _writer
    if _writer is None:
        _writer = AsyncWriter()
    return _writer


class BufferStager(AsyncStager):
    """``torch.distributed.checkpoint``'s staging step, into the reused CPU buffers of a SnapshotBuffers.

    The copy is complete when :meth:`stage` returns (``async_save`` then writes from it on its
    thread); the buffers belong to the caller, who takes the next snapshot only after the write.

    Example::

        dcp.async_save(state, checkpoint_id=tmp, process_group=group, async_stager=BufferStager(buffers))
    """

    _synchronize_after_execute = False

    def __init__(self, buffers: SnapshotBuffers) -> None:
        self.buffers = buffers

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.buffers.snapshot(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass  # the buffers outlive one save


def checkpoint_group() -> Any:
    """The gloo group of every rank that background checkpoint collectives use (made once: a collective).

    Example::

        group = checkpoint_group()      # on every rank, at the same point (the first async save)
    """
    global _group
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo"))
    return _group[1]


def save_checkpoint_dir_async(
    path: str,
    state: dict[str, Any],
    meta: dict[str, Any],
    tag: dict[str, Any],
    writer: AsyncWriter,
    buffers: SnapshotBuffers,
) -> None:
    """Every rank: start writing ``state`` (this rank's shards) and rank 0's ``meta`` as directory ``path``.

    Waits for the previous save of ``writer`` (:func:`background_writer`) first; returns once this
    rank's state is copied into ``buffers``. ``writer.poll()`` / ``writer.wait()`` then give the
    background's error on each rank.

    Raises:
        Exception: on every rank, the previous background save's error or this one's start's.

    Example::

        writer, buffers = background_writer(), SnapshotBuffers()
        save_checkpoint_dir_async("ckpt/step=10.ckpt", state, meta, {"step": 10}, writer, buffers)
        ...                                                   # training goes on
        error = writer.wait()
    """
    agree(writer.wait())  # the previous save ended on every rank; its buffers are free again
    group = checkpoint_group() if distributed_ready() else None
    tmp = begin_checkpoint_dir(path, group)
    error, upload = None, None
    try:
        rank0 = not distributed_ready() or dist.get_rank() == 0
        meta = snapshot(meta) if rank0 else meta  # the loops' and callbacks' dicts change as training goes on
        stager = BufferStager(buffers)
        upload = dcp.async_save(state, checkpoint_id=tmp, process_group=group, async_stager=stager)
    except Exception as err:
        error = err
    try:
        agree(error)
    except BaseException:
        abandon_checkpoint_dir(tmp)
        raise
    writer.submit(lambda: _publish_when_written(upload, tmp, os.path.abspath(path), meta, tag, group))


def _publish_when_written(upload: Any, tmp: str, path: str, meta: dict, tag: dict, group: Any) -> None:
    try:
        upload.result()  # torch raises on every rank when one failed
        finish_checkpoint_dir(tmp, path, meta, tag, group)
    except BaseException:
        abandon_checkpoint_dir(tmp)
        raise
