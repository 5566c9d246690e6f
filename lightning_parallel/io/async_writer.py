"""One background save in flight: snapshot on the caller's thread, write on a worker thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["AsyncWriter", "SnapshotBuffers", "snapshot"]


def snapshot(
    obj: Any,
    copy: Callable[[torch.Tensor, tuple[Hashable, ...]], torch.Tensor] | None = None,
) -> Any:
    """Copy every tensor of a nested checkpoint dict to CPU memory; copy the containers too.

    The training loop keeps mutating parameters, optimizer state and the callbacks' own dicts
    (``ModelCheckpoint.best_k_models`` is returned by reference), so both must be copied before a
    background write. Other leaves (numbers, strings, hyper-parameters) are shared. A tensor that
    appears twice (tied weights, also as two objects viewing the same memory) is copied once. Each
    tensor goes to fresh memory, or to ``copy(tensor, path)`` (``path``: the keys and indices
    leading to it), as :class:`SnapshotBuffers` does.

    Example::

        state = snapshot({"model": model.state_dict(), "step": 10})
    """
    memo: dict[Hashable, torch.Tensor] = {}
    return _snapshot(obj, (), copy or _fresh_copy, memo)


def _alias_key(t: torch.Tensor) -> Hashable:
    """Equal for two tensor objects that view the same memory the same way (``state_dict()`` detaches
    each entry anew, so tied weights arrive as distinct objects)."""
    if isinstance(t, DTensor):  # a wrapper without storage of its own: its local shard's
        return "dtensor", _alias_key(t.to_local()), tuple(t.shape), str(t.placements)
    if t.layout != torch.strided or t.device.type == "meta":
        return id(t)
    storage = t.untyped_storage().data_ptr()
    return storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device


def _snapshot(obj: Any, path: tuple[Hashable, ...], copy: Callable[..., torch.Tensor], memo: dict) -> Any:
    if isinstance(obj, torch.Tensor):
        key = _alias_key(obj)
        if key not in memo:
            memo[key] = copy(obj, path)
        return memo[key]
    if isinstance(obj, dict):
        out = obj.copy()  # keeps the dict subclass (OrderedDict, AttributeDict...)
        for k, v in obj.items():
            out[k] = _snapshot(v, (*path, k), copy, memo)
        return out
    if isinstance(obj, list):
        return [_snapshot(v, (*path, i), copy, memo) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_snapshot(v, (*path, i), copy, memo) for i, v in enumerate(obj))
    return obj


class SnapshotBuffers:
    """:func:`snapshot` into CPU buffers allocated at the first save and reused by the next ones.

    Copying into memory that is already mapped costs a memcpy; a fresh allocation of the same size
    also pays a page fault per page, which makes the stall of an asynchronous save several times
    longer. Buffers are keyed by the tensor's place in the checkpoint dict and its shape and
    dtype; those the latest snapshot did not use are dropped, so they hold one checkpoint's tensors
    (+1.0x its size, kept until :meth:`release`). Copies from CUDA go to pinned memory and are
    complete when :meth:`snapshot` returns.

    A snapshot overwrites the previous one: take the next one only after the write of the previous
    one has finished (``AsyncWriter.wait()``).

    Example::

        buffers, writer = SnapshotBuffers(), AsyncWriter()
        error = writer.wait()  # the previous snapshot is free again
        state = buffers.snapshot(checkpoint)
        writer.submit(lambda: save_checkpoint_file(state, "last.ckpt"))
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Hashable, ...], torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_buffers": {}}  # a pickled callback travels without its buffers

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def snapshot(self, obj: Any) -> Any:
        """Like :func:`snapshot`, but every plain tensor is copied into its reused buffer."""
        used: dict[tuple[Hashable, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()
        out = snapshot(obj, copy=lambda t, path: self._copy(t, path, used, devices))
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking copies must land before the write reads them
        self._buffers = used
        return out

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates again)."""
        self._buffers = {}

    def _copy(
        self,
        t: torch.Tensor,
        path: tuple[Hashable, ...],
        used: dict[tuple[Hashable, ...], torch.Tensor],
        devices: set[torch.device],
    ) -> torch.Tensor:
        if isinstance(t, DTensor) and t.device_mesh.device_type == "cpu":
            # An FSDP2 / tensor-parallel shard: this rank's local tensor into its buffer, placed as before.
            local = self._copy(t.to_local(), (*path, "local"), used, devices)
            return DTensor.from_local(
                local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        if t.layout != torch.strided or t.is_quantized or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return _fresh_copy(t)
        key = (*path, tuple(t.shape), t.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        used[key] = buffer
        buffer.copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda:
            devices.add(t.device)
        return buffer


def _fresh_copy(t: torch.Tensor, path: tuple[Hashable, ...] = ()) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class AsyncWriter:
    """Run one write job at a time on a background thread; a new job first waits for the previous one.

    Follow-up actions (removing an evicted checkpoint, re-pointing a link) registered with
    :meth:`after` run on the worker once the current job has succeeded, and are dropped if it failed,
    so an old checkpoint is never deleted before its replacement is on disk.

    Example::

        writer = AsyncWriter()
        writer.submit(lambda: save_checkpoint_file(snapshot(state), "last.ckpt"))
        writer.after(lambda: remove_file("epoch=0.ckpt"))
        error = writer.wait()  # None, or the exception the job raised
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False
        self._followups: list[Callable[[], Any]] = []
        self._error: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Spawn launchers pickle the callbacks: a writer travels empty (locks and threads cannot).
        if self.in_flight:
            raise RuntimeError("cannot pickle an AsyncWriter with a save in flight: call wait() first")
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    @property
    def in_flight(self) -> bool:
        with self._lock:
            return self._running

    def submit(self, job: Callable[[], Any]) -> BaseException | None:
        """Wait for the previous job, then start ``job``; return the previous error (then not started)."""
        error = self.wait()
        if error is not None:
            return error
        with self._lock:
            self._running = True
        self._thread = threading.Thread(target=self._run, args=(job,), name="rank0-ckpt-writer", daemon=True)
        self._thread.start()
        return None

    def after(self, action: Callable[[], Any]) -> None:
        """Run ``action`` after the job in flight succeeds; now if none is; never if the last one failed."""
        with self._lock:
            if self._running:
                self._followups.append(action)
                return
            if self._error is not None:
                return  # the last job failed: keep what it was meant to replace
        action()

    def poll(self) -> tuple[bool, BaseException | None]:
        """(done, error) without blocking; the error is reported once and then cleared."""
        with self._lock:
            if self._running:
                return False, None
            error, self._error = self._error, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return True, error

    def wait(self) -> BaseException | None:
        """Block until no job is in flight; return (and clear) the error of the last job, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            error, self._error = self._error, None
        return error

    def _run(self, job: Callable[[], Any]) -> None:
        try:
            job()
            while True:
                with self._lock:
                    if not self._followups:
                        self._running = False
                        return
                    action = self._followups.pop(0)
                action()
        except BaseException as err:
            with self._lock:
                self._error = err
                self._followups.clear()
                self._running = False
