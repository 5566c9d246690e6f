"""The disk tier's bounded host buffer: three chunk slots and a work area, a reader and a writer thread.

While the host steps chunk ``i`` in one slot, the reader thread fills the next slot with chunk ``i + 1``
and the writer thread writes chunk ``i - 1`` back from the third: the step's time is the disk's as far
as the two overlap. The slots and the work area are all the host memory the tier holds for the state,
whatever its size (the first step too, where the class's first state is zeros: it is made in the slot,
``disk_chunk.py``; else the class makes a chunk's state before it is copied into the slot: one chunk's
state more, for a moment); :class:`HostBuffers` counts them (the tests' measured peak). The process's
resident memory over a step is measured by ``experiments/bench_offload.py`` (``_offload_resident.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
SLOTS = 3


class HostBuffers:
    """Bytes held in the tier's host buffers, now and at most (``peak``).

    Example::

        >>> buffers = HostBuffers()
        >>> slot = buffers.allocate(1024, pin_memory=False)
        >>> buffers.free(slot); buffers.held, buffers.peak
        (0, 1024)
    """

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def allocate(self, nbytes: int, pin_memory: bool) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes (page-locked with ``pin_memory``), counted."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        self.held -= buffer.numel()


class Stream(Generic[T]):
    """Steps a list of chunks through ``SLOTS`` slots of ``slot_bytes`` and one work area of
    ``work_bytes`` (host buffers from ``buffers``; only the work area is pinned: it is what the device
    copies read and write).

    Example::

        stream = Stream(HostBuffers(), slot_bytes=2**26, work_bytes=2**26, pin_memory=False)
        stream.run(chunks, read=load, step=step_one, write=store)   # read/write on their threads
        stream.close()
    """

    def __init__(self, buffers: HostBuffers, slot_bytes: int, work_bytes: int, pin_memory: bool) -> None:
        self._buffers = buffers
        self.slots = [buffers.allocate(slot_bytes, False) for _ in range(SLOTS)]
        self.work = buffers.allocate(work_bytes, pin_memory)
        self.waited = 0.0  # seconds the steps waited for a read or a write (the disk's share not hidden)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")

    def run(
        self,
        items: Sequence[T],
        read: Callable[[T, torch.Tensor], None],
        step: Callable[[T, torch.Tensor, torch.Tensor], bool],
        write: Callable[[T, torch.Tensor], None],
    ) -> None:
        """For each item in order: ``read(item, slot)`` on the reader thread, ``step(item, slot, work)``
        here once it is read, then ``write(item, slot)`` on the writer thread if ``step`` returned True.
        A failure anywhere is raised here, after every thread let go of the slots."""
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}
        try:
            if items:
                reads[0] = self._reader.submit(read, items[0], self.slots[0])
            for i, item in enumerate(items):
                if i + 1 < len(items):
                    if i + 1 - SLOTS in writes:  # the slot chunk i + 1 reads into is written back first
                        self._wait(writes.pop(i + 1 - SLOTS))
                    slot = self.slots[(i + 1) % SLOTS]
                    reads[i + 1] = self._reader.submit(read, items[i + 1], slot)
                self._wait(reads.pop(i))
                if step(item, self.slots[i % SLOTS], self.work):
                    writes[i] = self._writer.submit(write, item, self.slots[i % SLOTS])
            for i in sorted(writes):
                self._wait(writes.pop(i))
        finally:
            for future in [*reads.values(), *writes.values()]:
                future.exception()  # (waits; the first failure was raised already)

    def _wait(self, future: Future) -> None:
        start = time.perf_counter()
        future.result()
        self.waited += time.perf_counter() - start

    def close(self, wait: bool = True) -> None:
        """Stop the threads (``wait``: until they end; a garbage collector's finalizer must not wait:
        joining a thread from inside a collection can deadlock with a thread being started) and give the
        buffers back."""
        self._reader.shutdown(wait=wait)
        self._writer.shutdown(wait=wait)
        for buffer in [*self.slots, self.work]:
            self._buffers.free(buffer)
        self.slots, self.work = [], torch.empty(0, dtype=torch.uint8)
