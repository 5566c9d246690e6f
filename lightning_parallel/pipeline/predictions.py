"""Put the replicas' predictions for one batch step back in dataset order.

Lightning's prediction sampler hands replica ``r`` the samples ``r, r + R, r + 2R, ...`` (strided, not
padded). Batch ``b`` of every replica together therefore covers one contiguous block of the data set,
in which replica ``r``'s ``j``-th sample sits at position ``j * R + r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def interleave_replicas(parts: Sequence[Any]) -> Any:
    """Merge per-replica predictions (same structure, tensors batched along dim 0) in dataset order.

    Example::

        >>> interleave_replicas([torch.tensor([0, 2, 4]), torch.tensor([1, 3])])
        tensor([0, 1, 2, 3, 4])
    """
    if len(parts) == 1:
        return parts[0]
    return torch.utils._pytree.tree_map(lambda *leaves: _interleave(leaves), *parts)


def _interleave(leaves: Sequence[Any]) -> Any:
    if not all(torch.is_tensor(t) and t.dim() > 0 for t in leaves):
        raise TypeError(
            "predictions from several pipeline replicas can be put in dataset order only when "
            "predict_step returns tensors (or tuples/dicts of tensors) batched along dim 0"
        )
    replicas = len(leaves)
    out = leaves[0].new_empty((sum(len(t) for t in leaves), *leaves[0].shape[1:]))
    for r, t in enumerate(leaves):
        out[r::replicas] = t
    return out
