"""The offload technique's settings checked: what may be offloaded beside which data parallelism, what
tensor parallelism allows, the disk tier's directory and buffer (each with the reason and the fix)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from lightning_parallel._options import unknown_option_error
from lightning_parallel.layout.choices import OFFLOAD_TARGETS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def checked_offload(offload: Any, data_parallel: str) -> tuple[str, ...]:
    """What lives on the host, as a sorted tuple of :data:`OFFLOAD_TARGETS` (a name or a list of names).

    ``"parameters"`` is FSDP2's offload, which takes the optimizer state with it (all or nothing): it
    implies ``"optimizer"`` and needs ``data_parallel="fsdp"``. ``"optimizer"`` alone works with every
    data-parallel mode (FSDP2's shards then stay on the device).

    Example::

        >>> checked_offload("optimizer", "replicate")
        ('optimizer',)
        >>> checked_offload(["parameters"], "fsdp")
        ('optimizer', 'parameters')
        >>> checked_offload("optimizer", "fsdp")
        ('optimizer',)
    """
    if offload is None or offload is False:
        return ()
    names = (offload,) if isinstance(offload, str) else offload
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"offload must be one of {', '.join(map(repr, OFFLOAD_TARGETS))} or a list of them, got "
            f"{offload!r}"
        )
    for name in names:
        if name not in OFFLOAD_TARGETS:
            raise unknown_option_error("PipelineStrategy(offload=...)", name, OFFLOAD_TARGETS)
    chosen = set(names) | ({"optimizer"} if "parameters" in names else set())
    if "parameters" in chosen and data_parallel != "fsdp":
        raise ValueError(
            f"offload='parameters' is FSDP2's offload of each stage's sharded parameters and gradients, but "
            f"data_parallel={data_parallel!r}: use data_parallel='fsdp', or offload='optimizer' (the "
            f"optimizer state and its step on the host)"
        )
    return tuple(sorted(chosen))


def check_offload(offload: tuple[str, ...], tensor_parallel_size: int, parallelize_fn: Any) -> None:
    """Refuse offload where it is not supported yet, with the reason and the fix.

    Raises:
        ValueError: offload with tensor-parallel stages; FSDP2's offload with a ``parallelize_fn``.

    Example::

        >>> check_offload(("optimizer",), 1, None)          # fine
    """
    if offload and tensor_parallel_size > 1:
        raise ValueError(
            f"offload={list(offload)} with tensor_parallel_size={tensor_parallel_size} is not supported yet: "
            f"the host copies and their checkpoints are written for whole tensors, not tensor-parallel "
            f"DTensor slices, and FSDP2's offload of 2-D shards is untested here. Use tensor_parallel_size=1 "
            f"(data_parallel='fsdp' with offload='parameters' shards each stage over all its ranks instead), "
            f"or drop offload"
        )
    if "parameters" in offload and parallelize_fn is not None:
        raise ValueError(
            "offload='parameters' with a parallelize_fn is not supported: a stage your function shards "
            "with fully_shard would keep its shards on the device (PipelineStrategy gives FSDP2's "
            "CPUOffloadPolicy to the stages it shards itself). Drop parallelize_fn and let "
            "data_parallel='fsdp' shard the stages, or pass offload_policy=CPUOffloadPolicy() to your "
            "own fully_shard and drop offload='parameters'"
        )


def check_disk(offload: tuple[str, ...], offload_to: str, offload_dir: Any, offload_buffer: Any) -> None:
    """Refuse a disk tier that cannot work, or its options without it, with the fix (the directory itself
    is checked on each rank when the optimizers are built: it may differ between nodes).

    Raises:
        ValueError: ``"disk"`` without ``"optimizer"`` or with ``"parameters"``; no ``offload_dir`` with
            ``"disk"``, or ``offload_dir`` / ``offload_buffer`` without it.
        TypeError: ``offload_dir`` is no path.

    Example::

        >>> check_disk(("optimizer",), "disk", "/local_nvme/offload", None)    # fine
    """
    if offload_to != "disk":
        for name, value in (("offload_dir", offload_dir), ("offload_buffer", offload_buffer)):
            if value is not None:
                raise ValueError(
                    f"{name}={value!r} sets the disk tier, but offload_to={offload_to!r}: add "
                    f"offload_to='disk' (with offload='optimizer'), or drop {name}"
                )
        return
    if "optimizer" not in offload:
        raise ValueError(
            f"offload_to='disk' moves the optimizer state to files, but offload={list(offload)}: add "
            f"'optimizer' to offload"
        )
    if "parameters" in offload:
        raise ValueError(
            "offload_to='disk' with offload='parameters' is not supported yet (FSDP2's host shards stepped "
            "from files is untested): use offload='optimizer' with data_parallel='fsdp' (the shards on the "
            "device, their optimizer state on the disk)"
        )
    if offload_dir is None:
        raise ValueError(
            "offload_to='disk' needs offload_dir: the directory (on a local disk, ideally NVMe) under which "
            "each rank keeps its optimizer state in <offload_dir>/rank<R>"
        )
    if not isinstance(offload_dir, str | os.PathLike):
        raise TypeError(f"offload_dir must be a path, got {offload_dir!r}")


def buffer_bytes(size: Any) -> int:
    """``offload_buffer`` in bytes: an int, or a size such as ``"512MiB"`` or ``"1GB"``.

    Example::

        >>> buffer_bytes("64MiB"), buffer_bytes(4096)
        (67108864, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(f"offload_buffer={size!r} is no size: write e.g. 1GiB, 512MiB or an int")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"offload_buffer must be a positive size, got {size!r}")
    return value
