"""A stage's gradients: held aside for Lightning's backward, averaged over replicas, clipped globally."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_parallel.distributed.dtensors import local
from lightning_parallel.distributed.tensors import all_reduce_coalesced


def all_reduce_gradients(
    params: Iterable[torch.Tensor], group: dist.ProcessGroup | None, skip: Collection[torch.Tensor] = ()
) -> None:
    """Average the gradients of ``params`` over ``group`` in one coalesced all-reduce (per dtype).

    Called once per optimizer step, after the last accumulated backward: no sync per micro-batch.
    A tensor-parallel (DTensor) gradient averages its local shard: the data-parallel peers of a
    tensor-parallel rank hold the same slice. ``skip``: parameters whose gradients FSDP reduces itself.
    """
    skipped = {id(p) for p in skip}
    grads = [local(p.grad) for p in params if p.grad is not None and id(p) not in skipped]
    all_reduce_coalesced(grads, group, average=True)


def clip_grad_norm_across(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    not_counted: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over every stage of the pipeline.

    Each stage holds a slice of the model's gradients; the sum of squares (or the max, for the inf
    norm) is reduced over ``group`` so every stage scales by the same coefficient a single device would.
    A sharded (DTensor) gradient counts its local shard, reduced first over the mesh dimensions it is
    sharded on (not those it is replicated on). ``not_counted`` are replicas of tied weights whose norm
    another stage counts (one count per weight).
    """
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in not_counted}
    grads = [p.grad for p in params]
    counted = [p.grad for p in params if id(p) not in skip]
    device = local(grads[0]).device if grads else torch.device("cpu")
    inf = norm_type == float("inf")
    op = "max" if inf else "sum"
    total = _local_norm_term([g for g in counted if not isinstance(g, DTensor)], norm_type, device)
    for groups, shards in _by_shard_groups([g for g in counted if isinstance(g, DTensor)]).items():
        term = _local_norm_term(shards, norm_type, device)
        for shard_group in groups:
            all_reduce_coalesced([term], shard_group, op=op)
        total = torch.maximum(total, term) if inf else total + term
    all_reduce_coalesced([total], group, op=op)
    total = total if inf else total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local(g).detach().mul_(coef.to(g.device, g.dtype))
    return total


def _local_norm_term(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the norm: the max (inf norm) or the sum of the norm_type-th powers."""
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).float() for g in grads])
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _by_shard_groups(grads: Sequence[DTensor]) -> dict[tuple[Any, ...], list[torch.Tensor]]:
    """Local shards, keyed by the process groups of the mesh dimensions they are sharded on."""
    out: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for g in grads:
        mesh = g.device_mesh
        # Any placement but Replicate is a shard: FSDP2 over tensor-parallel weights shards its dimension
        # with _StridedShard, which is no Shard (torch 2.13: is_shard() is False).
        groups = tuple(mesh.get_group(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
        out.setdefault(groups, []).append(g.to_local())
    return out
