"""How many samples a batch holds: dim 0 of its first batched tensor.

Pure PyTorch. The pipeline splits every tensor of a batch along dim 0 into micro-batches, and the
accumulation scheduler checks each batch against the loader's layout: both count samples this way.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["samples_in"]


def samples_in(batch: Any) -> int | None:
    """Dim 0 of the first tensor with a dimension in ``batch`` (nested tuples, lists, dicts), or None.

    Scalars (0-dim tensors, numbers, strings) hold no samples and are skipped.

    Example::

        samples_in((torch.zeros(8, 3), torch.zeros(8)))          # 8
        samples_in({"lr": torch.tensor(0.1), "ids": torch.zeros(4, 16)})   # 4
        samples_in(["no", "tensor"])                              # None
    """
    # torch 2.13 has no public pytree module; torch.distributed.pipelining splits batches with this one.
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if torch.is_tensor(leaf) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None
