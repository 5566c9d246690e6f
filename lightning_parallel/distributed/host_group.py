"""A process group that carries CPU tensors: for bytes and objects that live in host memory.

``broadcast_object_list`` on an NCCL group copies the pickled bytes to the GPU and back; a few
megabytes of a traced program have no business there, and the GPU of a rank may be busy or full.
:func:`host_group` gives the group itself when its backend runs CPU tensors (gloo, or a default group
initialised with both ``cpu:gloo`` and ``cuda:nccl``), else a gloo group over the same ranks, made
once. Pure PyTorch (no Lightning import).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_parallel.distributed.agree import distributed_ready

__all__ = ["host_group", "runs_cpu_tensors"]

_twins: dict[Any, Any] = {}  # a group that cannot run CPU tensors -> its gloo twin


def runs_cpu_tensors(group: Any | None = None) -> bool:
    """Whether collectives on ``group`` take CPU tensors (its backend config has a ``cpu:`` entry)."""
    return "cpu:" in dist.get_backend_config(group)


def host_group(group: Any | None = None) -> Any | None:
    """``group`` if its collectives take CPU tensors, else a gloo group over the same ranks.

    The gloo twin is made at the first call on the group's ranks (only its members take part:
    ``use_local_synchronization``) and kept for the next calls: call it on every rank of ``group``
    at the same point, as any collective. Without a process group it returns ``group``.

    Example::

        host = host_group(pp_group)          # pp_group on gloo, or its gloo twin under NCCL
        broadcast_object(payload, src=first, group=host)
    """
    if not distributed_ready() or runs_cpu_tensors(group):
        return group
    key = group if group is not None else dist.group.WORLD
    if key not in _twins:
        ranks = dist.get_process_group_ranks(key)
        _twins[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _twins[key]
