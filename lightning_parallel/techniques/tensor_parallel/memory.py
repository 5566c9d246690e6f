"""The planner's view of tensor parallelism: one tensor-parallel rank's local model, measured as any other.

Under ``tensor_parallel_size=t`` a rank computes with slices: a column-wise split Linear has ``1/t`` of
its outputs, a row-wise split one ``1/t`` of its inputs, and the attention runs ``heads / t`` heads.
:func:`local_model` builds exactly that computation on one process (a copy whose split linears are
smaller ``nn.Linear`` layers and whose head counts are divided), so the planner's probe measures the
local parameters, gradients, optimizer state and activations directly; what the plan leaves whole
(embeddings, norms, heads, the residual stream, the stage boundaries) stays whole. Not counted: the
DTensor wrappers' transient copies around the all-reduces. :func:`row_splits` counts the all-reduces of
each unit, which the time model charges (``TensorParallel.time``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan


def local_model(module: nn.Module, plan: TensorPlan, tp_size: int) -> nn.Module:
    """A copy of ``module`` computing what one of ``tp_size`` tensor-parallel ranks computes under ``plan``
    (the traced path's plan with the head counts of one rank: a Hugging Face attention reads -1).

    Example::

        local = local_model(model, default_plan(model.layers, "layers", 2), 2)
        facts = measure_model(local, batch)   # as measure_model(..., tensor_parallel_size=2)
    """
    if tp_size == 1:
        return module
    local = copy.deepcopy(module)
    for path, style in plan.styles.items():
        parent_path, _, name = path.rpartition(".")
        parent = local.get_submodule(parent_path)
        old = getattr(parent, name)
        if isinstance(style, ColwiseParallel):
            shape = (old.in_features, old.out_features // tp_size)
        elif isinstance(style, RowwiseParallel):
            shape = (old.in_features // tp_size, old.out_features)
        else:
            continue
        w = old.weight
        setattr(parent, name, nn.Linear(*shape, bias=old.bias is not None, device=w.device, dtype=w.dtype))
    for path, counts in plan.head_counts.items():
        for attr, value in counts.items():
            setattr(local.get_submodule(path), attr, value)
    return local


def row_splits(plan: TensorPlan, units: Sequence[str]) -> dict[str, int]:
    """Per unit, its row-wise split layers: one activation all-reduce each in forward (and in backward).

    Example::

        row_splits(default_plan(model.layers, "layers", 2), ["layers.0", "layers.1"])   # {'layers.1': 2, ...}
    """
    out = {}
    for unit in units:
        rows = [
            p
            for p, style in plan.styles.items()
            if p.startswith(unit + ".") and isinstance(style, RowwiseParallel)
        ]
        if rows:
            out[unit] = len(rows)
    return out
