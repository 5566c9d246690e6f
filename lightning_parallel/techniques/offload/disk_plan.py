"""The disk tier for the planner: the bytes it keeps in files, and the seconds its streaming adds.

* :func:`state_to_disk` - a rank's optimizer state off the device into its disk column (the host keeps
  the buffer the state streams through, :func:`host_buffer`: as the tier sizes it, at most the bound);
* :func:`disk_seconds` - per optimizer step the files are read once and written once at the disk's
  bandwidth (``links.disk``, measured once in ``offload_dir``: ``disk_rate.py``), overlapped with the host
  step chunk by chunk (``disk_stream.py``): what outlasts the host step, and one chunk's read and write
  that nothing overlaps (the first read, the last write).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_parallel.techniques.contract import MemoryLedger, TimeLedger
from lightning_parallel.techniques.offload.disk_stream import SLOTS
from lightning_parallel.techniques.offload.disk_tier import split_bytes


def file_bytes(trainable: Iterable[Any]) -> int:
    """Bytes of the state in files for these tensors (``TensorFacts``), unsharded: the state in the host
    step's dtype (fp32 for bf16 / fp16 parameters, with an fp32 master of each: ``disk_group.py``).

    Example::

        in_files = file_bytes(t for t in facts.tensors.values() if t.grad)
    """
    return sum(
        _file_bytes_per_element(t) * t.numel + (t.state.per_tensor if t.state else 0) for t in trainable
    )


def _file_bytes_per_element(t: Any) -> int:
    """A tensor's bytes per element in the files: its state in fp32 (bf16 / fp16 parameters are stepped in
    fp32) and, for those, the fp32 master."""
    low = t.nbytes < 4 * t.numel
    scale = 4 * t.numel // t.nbytes if low else 1
    return (t.state.per_element if t.state else 0) * scale + (4 if low else 0)


def state_to_disk(ledger: MemoryLedger, trainable: list[Any], buffer: int) -> None:
    """The rank's optimizer state (its ZeRO-1 or FSDP2 share) off the device into its files; the host
    holds only the buffer the state streams through (:func:`host_buffer`: at most ``buffer``, the plan's
    ``offload_buffer``), whatever the state's size (the chunks' gradients and parameters pass through its
    work area)."""
    device, whole = ledger.device, ledger.whole["optimizer"]
    share = device["optimizer"] / whole if whole else 1.0  # (ZeRO-1 and FSDP2 step their share)
    device["optimizer"] = 0
    ledger.disk["optimizer"] = ledger.disk.get("optimizer", 0) + round(file_bytes(trainable) * share)
    ledger.add_host("optimizer", host_buffer(trainable, share, buffer))
    ledger.notes.append(
        "offload_to='disk': the files are read and written once per optimizer step at the links' disk "
        "bandwidth (measured in offload_dir, or --disk-bandwidth), overlapped with the host step chunk by "
        "chunk; without one, the step time is host offload's"
    )


def host_buffer(trainable: list[Any], share: float, buffer: int) -> int:
    """Bytes of host buffer the tier allocates for these tensors' state (``share`` of it: the rank's
    ZeRO-1 or FSDP2 share) under a bound of ``buffer``: its slots and work area sized as the optimizer
    sizes them (``disk_tier.split_bytes``), taking the tensors as one param group (the most it holds: a
    chunk never spans two groups), so a small model's tier counts what it holds, not the whole bound.

    Example::

        ledger.add_host("optimizer", host_buffer(trainable, 1.0, 2**30))
    """
    elements = sum(t.numel for t in trainable)
    if not elements:
        return 0
    low = [t for t in trainable if t.nbytes < 4 * t.numel]  # (bf16 / fp16: an fp32 master in the file)
    state = max(_file_bytes_per_element(t) for t in trainable)
    work = 8 + max((t.nbytes // t.numel for t in low), default=0)  # (gradient, parameter, rounding)
    try:
        slot, area = split_bytes(state, work, state // 4, round(elements * share), buffer)
    except ValueError:  # (a buffer too small for the tier: refused when it is built, with the fix)
        return buffer
    return min(buffer, SLOTS * slot + area)


def disk_seconds(ledger: TimeLedger, host_step: float, buffer: int) -> float:
    """Seconds the rank's disk tier adds to its optimizer step beyond the host step (``host_step``): the
    read and the write of its files at ``ledger.links.disk`` (0 where the links have no disk).

    Example::

        ledger.tail["offload"] += disk_seconds(ledger, step, 2**30)
    """
    disk = getattr(ledger.links, "disk", None)
    if disk is None:
        return 0.0
    trainable = [ledger.facts.tensors[k] for k in ledger.keys if ledger.facts.tensors[k].grad]
    elements = sum(t.numel for t in trainable)
    share = min(1.0, ledger.step_elements / elements) if elements else 1.0  # (ZeRO-1 / FSDP2's shard)
    state = file_bytes(trainable) * share
    chunk = min(state, buffer / (SLOTS + 1))  # (a slot: the buffer's slots and work area, about equal)
    return max(0.0, 2 * disk.time(state) - host_step) + 2 * disk.time(chunk)
