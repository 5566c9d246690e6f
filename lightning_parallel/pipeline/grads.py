"""Gradient collectives of a pipeline stage: one all-reduce over replicas, clipping by the global norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def all_reduce_gradients(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Average the gradients of ``params`` over ``group`` in one coalesced all-reduce (per dtype).

    Called once per optimizer step, after the last accumulated backward: no sync per micro-batch.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    size = dist.get_world_size(group)
    for same_dtype in by_dtype.values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(size)
        for g, synced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            g.copy_(synced)


def clip_grad_norm_across(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over every stage of the pipeline.

    Each stage holds a slice of the model's gradients; the sum of squares (or the max, for the inf
    norm) is reduced over ``group`` so every stage scales by the same coefficient a single device would.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    inf = norm_type == float("inf")
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).float() for g in grads])
        local = norms.max() if inf else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    total = local if inf else local.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
