"""Tensor collectives on many tensors at once: one flat buffer per dtype, one call each; subgroups.

Pure PyTorch (no Lightning import). The pipeline's gradient syncs (over replicas, over the ranks that
hold a tied weight) and its setup broadcasts go through these, so each costs one collective per
dtype whatever the number of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_parallel.distributed.agree import distributed_ready, world_size

__all__ = ["all_reduce_coalesced", "broadcast_coalesced", "new_subgroups"]


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], group: Any | None, average: bool = False, op: str = "sum"
) -> None:
    """Sum (``op="max"``: take the maximum; ``average``: the mean) of ``tensors`` in place over ``group``.

    One all-reduce per dtype, whatever the number of tensors.

    Example::

        all_reduce_coalesced([p.grad for p in params], mesh.group("gradients"), average=True)
    """
    size = world_size(group)
    if size == 1 or not tensors:
        return
    if average and any(not (t.is_floating_point() or t.is_complex()) for t in tensors):
        # Checked before the collective, so every rank raises instead of each failing after it.
        raise TypeError(
            "all_reduce_coalesced(average=True) needs floating tensors: an integer mean is not exact"
        )
    for same_dtype in _by_dtype(tensors):
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        if average:
            flat.div_(size)
        for t, synced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            t.copy_(synced)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: Any | None) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with global rank ``src``'s, one broadcast a dtype."""
    if world_size(group) == 1 or not tensors:
        return
    for same_dtype in _by_dtype(tensors):
        flat = _flatten_dense_tensors(same_dtype)
        dist.broadcast(flat, src=src, group=group)
        for t, synced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            t.copy_(synced)


def new_subgroups(rank_lists: Sequence[Sequence[int]], backend: str | None = None) -> Any | None:
    """Create one process group per list of global ranks (disjoint lists); return this rank's, or None.

    A collective: every rank calls it with the same lists, also ranks that belong to none of them.
    ``backend``: the groups' backend (``None``: the default group's).
    """
    if not distributed_ready():
        return None
    mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in rank_lists], backend=backend)
    return mine


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
