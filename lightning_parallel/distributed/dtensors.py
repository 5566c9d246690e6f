"""DTensor parameters seen as plain tensors: the local shard, the full tensor, a shard of a full one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing to it writes the DTensor), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensors(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its full tensor: a collective over each DTensor's mesh.

    Every rank of those meshes must call it with the same structure (a stage's state dict, in order).

    Example::

        full = full_tensors(stage.state_dict())     # plain tensors, the unsharded values
    """
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, Mapping):
        return {k: full_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(full_tensors(v) for v in tree)
    return tree


def distribute_like(value: Any, like: torch.Tensor) -> Any:
    """A full tensor as a DTensor placed as ``like`` (each rank keeps its slice: no communication).

    Anything else (``like`` not a DTensor, ``value`` of another shape, a scalar) comes back unchanged.

    Example::

        param.copy_(distribute_like(full_weight, param))
    """
    if not isinstance(like, DTensor) or not torch.is_tensor(value) or isinstance(value, DTensor):
        return value
    if value.shape != like.shape:
        return value
    value = value.to(like.device)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
