"""A sharded (DTensor) parameter's state on the host: its local shard as a plain host tensor, and host
tensors shown as DTensors placed as the parameter.

Offloading the optimizer of FSDP2 stages keeps each parameter's optimizer state as plain host tensors
shaped as its local shard; checkpoints expect the state of a DTensor parameter to be DTensors placed as
it (torch's ``state_dict`` layout, which DCP writes shard by shard and the consolidated save gathers).
:func:`placed_like` gives that view without copying (the data stays on the host), and :func:`host_local`
takes any value a checkpoint loads (a DTensor placed as the parameter or otherwise, a full tensor, a
shard) back to this rank's host shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.distributed.dtensors import distribute_like

HOST = torch.device("cpu")


def placed_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard of a tensor shaped as ``like``) as a DTensor placed as ``like``,
    sharing ``local``'s memory, wherever it is; ``like`` not a DTensor: ``local`` itself.

    ``DTensor.from_local`` would move a host ``local`` to the mesh's device (a CUDA mesh): the view is
    built as FSDP2 builds its offloaded shards (``_from_local_no_grad``), with the parameter's spec and
    ``local``'s dtype. Private torch (2.13: ``DTensor._spec``, a dataclass ``DTensorSpec`` with
    ``tensor_meta``); ``test_offload_shards.py`` checks it against ``from_local``.

    Example::

        exp_avg = placed_like(host_exp_avg, fsdp_param)   # a DTensor whose local tensor is on the host
    """
    if not isinstance(like, DTensor):
        return local
    meta = like._spec.tensor_meta
    meta = type(meta)(like.shape, like.stride(), local.dtype) if meta is not None else None
    spec = dataclasses.replace(like._spec, tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def host_local(value: Any, like: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
    """This rank's part of a loaded state ``value`` for the parameter ``like``, as a host tensor.

    A DTensor is redistributed as ``like`` if it is placed otherwise, then its local tensor taken; a
    full tensor of ``like``'s shape gives this rank's slice; a tensor of the local shard's shape is
    taken as it is; a 0-dim tensor (Adam's ``step``) or anything else comes back unchanged.
    ``dtype``: the floating-point tensors cast to it (the host's fp32).

    Example::

        host_local(loaded["exp_avg"], fsdp_param, torch.float32)   # the local shard's rows, on the host
    """
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    if isinstance(value, DTensor):
        if isinstance(like, DTensor) and tuple(value.placements) != tuple(like.placements):
            value = value.redistribute(like.device_mesh, like.placements)
        value = value.to_local()
    elif isinstance(like, DTensor) and value.shape == like.shape and value.shape != like.to_local().shape:
        value = distribute_like(value, like).to_local()
    value = value.detach().to(HOST)
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    return value


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The tensor the optimizer step writes: a DTensor's local shard (a view), else ``param`` itself.

    Example::

        local_view(fsdp_param).copy_(updated_host_shard)   # writes the DTensor's shard in place
    """
    if not isinstance(param, DTensor):
        return param.detach()
    with torch.no_grad():  # (to_local without autograd is the local tensor itself, not a copy)
        return param.to_local()
