"""A process group that carries CPU tensors: for bytes and objects that live in host memory.

``broadcast_object_list`` on an NCCL group copies the pickled bytes to the GPU and back; a few
megabytes of a traced program have no business there, and the GPU of a rank may be busy or full.
:func:`host_group` gives the group itself when its backend runs CPU tensors (gloo, or a default group
initialised with both ``cpu:gloo`` and ``cuda:nccl``), else a gloo group over the same ranks, made
once.

Where a job's host tensors meet collectives (FSDP2's offloaded shards), which backend its groups need is
decided here: :func:`process_group_backend`, the backend PipelineStrategy starts the process group with
(a host backend beside the device's); :func:`group_backend`, the backend the device mesh makes its own
groups with when the process group was started without one (by hand, or by an earlier fit in the same
process). Pure PyTorch (no Lightning import).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_parallel.distributed.agree import distributed_ready

__all__ = ["group_backend", "host_group", "process_group_backend", "runs_cpu_tensors"]

_twins: dict[Any, Any] = {}  # a group that cannot run CPU tensors -> its gloo twin


def runs_cpu_tensors(group: Any | None = None) -> bool:
    """Whether collectives on ``group`` take host (CPU) tensors: gloo, or a device backend with a host one
    beside it (``"cuda:nccl,cpu:gloo"``); NCCL alone does not. True without a process group.

    Example::

        if not runs_cpu_tensors():
            backend = "cuda:nccl,cpu:gloo"       # (what group_backend gives the mesh's groups)
    """
    if not distributed_ready():
        return True
    return "cpu:" in dist.get_backend_config(group)  # (gloo's: "cpu:gloo,cuda:gloo")


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


def process_group_backend(device_type: str, given: str | None) -> str | None:
    """The job's backend with a host backend beside the device's, for a job whose host tensors meet
    collectives (FSDP2's offloaded shards: clipping reduces their gradients' norm, a checkpoint gathers them):
    ``"cuda:nccl,cpu:gloo"``, as torchtitan does. A CPU job, or a backend that names a host one already,
    is left as given.

    Example::

        >>> process_group_backend("cuda", None), process_group_backend("cuda", "nccl")
        ('cuda:nccl,cpu:gloo', 'cuda:nccl,cpu:gloo')
        >>> process_group_backend("cpu", None) is None
        True
    """
    if device_type == "cpu" or (given is not None and ("cpu:" in given or given == "gloo")):
        return given
    device_backend = given or {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}.get(device_type, "nccl")
    return f"{device_type}:{device_backend},cpu:gloo"


def group_backend(device_type: str, host_tensors: bool) -> str | None:
    """The backend the job's own groups (its device mesh's) are made with: ``None``, the default group's,
    unless host tensors meet their collectives (``host_tensors``) and the default group takes none; then
    the device's with a host one beside (:func:`process_group_backend`).

    Example::

        >>> group_backend("cpu", True) is None and group_backend("cuda", False) is None
        True
    """
    if not host_tensors or device_type == "cpu" or runs_cpu_tensors():
        return None
    return process_group_backend(device_type, str(dist.get_backend()))
