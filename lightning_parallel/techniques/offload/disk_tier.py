"""The disk tier's settings (:class:`DiskTier`: where the files go, the host buffer's bound) and how that
bound divides between the stream's slots and its work area.

The bound (``offload_buffer``, 1 GiB by default) is all the host memory the tier holds for the state, so
the chunks' size follows from it: each of the ``SLOTS`` slots holds one chunk's state, the work area its
gradients, parameters and their rounding (``disk_stream.py``). :func:`buffer_split` gives each its
share, sized to the groups' bytes per element, or to the largest group whole where that takes less (a
small model's tier holds what it needs); :func:`max_elements` is then the chunk size of one group.
Apart from the optimizer (``disk_optimizer.py``): arithmetic on the settings and the groups' facts,
done before any file is laid out, and again when a param group joins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lightning_parallel.techniques.offload.disk_chunk import ALIGN, WORK_REGIONS
from lightning_parallel.techniques.offload.disk_group import GroupSpec
from lightning_parallel.techniques.offload.disk_layout import SPLIT
from lightning_parallel.techniques.offload.disk_stream import SLOTS


@dataclass(frozen=True)
class DiskTier:
    """Where and how the disk tier keeps an optimizer's state.

    Args:
        directory: the user's directory (``offload_dir``); each rank uses ``<directory>/rank<R>``.
        buffer_bytes: the host buffer's size: all the host memory the tier holds for the state.
        rank: the directory's rank (default: the global rank, or 0 without a process group).
        pin_memory: page-lock the work area (the device copies then run asynchronously).
        unnamed: unnamed files (``O_TMPFILE``): None where the filesystem has them, False never.

    Example::

        tier = DiskTier("/local_nvme/offload", buffer_bytes=2**30, pin_memory=True)
    """

    directory: str
    buffer_bytes: int = 2**30
    rank: int | None = None
    pin_memory: bool = False
    unnamed: bool | None = None

    def rank_now(self) -> int:
        """The rank whose directory this process uses."""
        if self.rank is not None:
            return self.rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def buffer_split(specs: list[GroupSpec], buffer_bytes: int) -> tuple[int, int]:
    """(a slot's bytes, the work area's bytes): ``SLOTS`` slots and the work area fill the buffer, or hold
    the largest group whole where that takes less (a chunk never holds more than one group: a small
    model's tier holds what it needs, not the whole default buffer; never fewer than ``SPLIT`` elements).

    Raises:
        ValueError: the buffer holds fewer than ``SPLIT`` elements per chunk, with the size it needs.
    """
    state = max((s.state_bytes for s in specs), default=0)
    work = max((s.work_bytes for s in specs), default=8)
    keys = max((len(s.keys) for s in specs), default=0)
    largest = max((sum(n for n in s.numels if n) for s in specs), default=0)
    return split_bytes(state, work, keys, largest, buffer_bytes)


def split_bytes(state: int, work: int, keys: int, largest: int, buffer_bytes: int) -> tuple[int, int]:
    """:func:`buffer_split` on the groups' numbers: ``state`` and ``work`` bytes per element in a slot and
    in the work area, ``keys`` state tensors per element, ``largest`` elements in the largest group (the
    planner sizes the tier's host buffer with it, from the model's facts, before any optimizer exists).

    Example::

        slot, work = split_bytes(8, 8, 2, 1_000, 2**30)   # AdamW, 1,000 elements: 3 x 8,128 + 8,192 bytes
    """
    slack = SLOTS * ALIGN * keys + WORK_REGIONS * ALIGN
    elements = (buffer_bytes - slack) // (SLOTS * state + work)
    if elements < SPLIT:
        raise ValueError(
            f"the disk tier's host buffer of {buffer_bytes} bytes holds {max(elements, 0)} elements per "
            f"chunk ({SLOTS} slots of {state} bytes and a work area of {work} bytes per element), fewer than "
            f"{SPLIT}: use a buffer of at least {slack + SPLIT * (SLOTS * state + work)} bytes (a few "
            f"hundred MiB keeps the disk busy)"
        )
    elements = min(elements, max(largest, SPLIT))
    return elements * state + ALIGN * keys, elements * work + WORK_REGIONS * ALIGN


def max_elements(spec: GroupSpec, slot_bytes: int, work_bytes: int) -> int:
    """The most elements of group ``spec`` one chunk holds: what a slot of ``slot_bytes`` holds of its
    state and a work area of ``work_bytes`` of its gradients and parameters (the work area alone where
    the group keeps no per-element state)."""
    by_work = (work_bytes - WORK_REGIONS * ALIGN) // spec.work_bytes
    if not spec.state_bytes:  # (no per-element state: only the work area bounds a chunk)
        return by_work
    return min((slot_bytes - ALIGN * len(spec.keys)) // spec.state_bytes, by_work)
