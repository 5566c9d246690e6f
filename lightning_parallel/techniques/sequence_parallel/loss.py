"""The loss of a sample split over a group: each shard's mean, weighted by its share of the tokens.

One device's loss is the mean over every labelled token of the batch (``ignore_index`` ignored). A
rank of a sequence-parallel group computes the mean over its shard's labelled tokens, ``n_i`` of them;
``mean_i * n_i / N`` (``N`` the group's labelled tokens, one all-reduce) summed over the group is one
device's loss, and so are the gradients summed over the group. Prompt tokens labelled ``-100`` make the
shards' counts unequal (the first shard holds the prompt), so a plain average of the shards' means
would not be exact: the counts are what make it so. Under ``PipelineStrategy`` this is the
:class:`~lightning_parallel.grads.item_weights.ItemWindow` arithmetic with the group's ranks counted as
replicas (items summed over data x sequence ranks, gradients averaged over them, then scaled by
``reference x ranks / items``).

A mean over a shard with no labelled token (a long prompt can fill the first shard) is ``0/0``: NaN as
a value, though its gradients are zeros (``F.cross_entropy``, torch 2.13, checked on the CPU), so a sum
over the group of the weighted values is NaN. A Hugging Face model is given a count instead
(:func:`~.labels.group_labels`: the loss is then a sum over it, 0 on such a shard); the pipeline's
``weighted_mean`` already skips a value of weight 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.agree import collective_device

__all__ = ["token_weight"]


def token_weight(items: torch.Tensor | int | float, group: Any) -> float:
    """``items / (items summed over group)``: what this rank's mean loss is multiplied by (a collective).

    A group without a labelled token weights every rank 0 (its loss is 0, as one device's mean over no
    tokens is not a number to train on).

    Example::

        count = (shard_labels != -100).sum()
        loss = F.cross_entropy(logits.flatten(0, 1), shard_labels.flatten()) * token_weight(count, group)
        # summed over the group's ranks: the mean over every labelled token of the batch
    """
    mine = torch.as_tensor(items, dtype=torch.float64).reshape(1).to(collective_device(group))
    total = mine.clone()
    dist.all_reduce(total, group=group)
    return float(mine) / float(total) if float(total) else 0.0
