"""One background save in flight: snapshot on the caller's thread, write on a worker thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AsyncWriter", "snapshot"]


def snapshot(obj: Any, _memo: dict[int, torch.Tensor] | None = None) -> Any:
    """Copy every tensor of a nested checkpoint dict to fresh CPU memory; copy the containers too.

    The training loop keeps mutating parameters, optimizer state and the callbacks' own dicts
    (``ModelCheckpoint.best_k_models`` is returned by reference), so both must be copied before a
    background write. Other leaves (numbers, strings, hyper-parameters) are shared. A tensor that
    appears twice (tied weights) is copied once.
    """
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            copy = obj.detach().to("cpu", copy=True)
            memo[key] = copy
        return memo[key]
    if isinstance(obj, dict):
        out = obj.copy()  # keeps the dict subclass (OrderedDict, AttributeDict...)
        for k, v in obj.items():
            out[k] = snapshot(v, memo)
        return out
    if isinstance(obj, list):
        return [snapshot(v, memo) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(v, memo) for v in obj)
    return obj


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
