"""Next-token labels at the shard boundaries, for a model that shifts its ``labels=`` itself.

A causal LM called with ``labels=`` predicts ``labels[t+1]`` at position ``t`` and shifts inside its
loss, so on a shard it would drop the shard's last position, whose label is the first token of the next
shard. Shifting before sharding gives each position its label (ALST passes the result as
``shift_labels``, which transformers 5's ``ForCausalLMLoss`` takes in place of shifting, with ``labels``
still given, as its loss needs). The shards are what the ranks hold here, so :func:`shift_across_shards`
builds exactly those shifted labels from them: each shard's first column goes to the previous rank (one
all-gather of ``b`` numbers per rank), the last shard ends with ``ignore_index``, as the last position
of the sequence does on one device. A batch that carries its own ``shift_labels`` (computed before
sharding) is sharded like any per-token tensor and left as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_parallel.distributed.agree import collective_device
from lightning_parallel.grads.item_weights import LabelledTokens, count_labelled

__all__ = [
    "IGNORE_INDEX",
    "ShardLabelledTokens",
    "group_labels",
    "labels_unshifted",
    "pass_group_labels",
    "shift_across_shards",
    "shifts_labels",
    "with_shift_labels",
]

# Hugging Face heads whose loss shifts ``labels`` (transformers' ``ForCausalLMLoss``).
_SHIFTING = ("ForCausalLM", "ForConditionalGeneration")
IGNORE_INDEX = -100  # (transformers' loss's default: the label of a position without a target)


def shift_across_shards(labels: torch.Tensor, group: Any, ignore_index: int = -100) -> torch.Tensor:
    """The next-token labels of this rank's shard: ``labels[t+1]`` of the whole sequence at each ``t``.

    Args:
        labels: this rank's shard of the labels, ``(b, t)``, tokens on dim 1.
        group: the sequence-parallel group, its ranks in shard order (a collective: every rank calls it).
        ignore_index: the label of the sequence's last position.

    Example::

        shift_labels = shift_across_shards(labels_shard, sp_group)   # (b, t), contiguous
    """
    firsts = [torch.empty_like(labels[:, :1]) for _ in range(dist.get_world_size(group))]
    dist.all_gather(firsts, labels[:, :1].contiguous(), group=group)
    index = dist.get_rank(group)
    following = firsts[index + 1] if index + 1 < len(firsts) else torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], following], dim=1)


@dataclass(frozen=True)
class ShardLabelledTokens:
    """``labelled_tokens(..., shift=True)`` on this rank's shard of each sequence: what the shard's loss
    averages over, the whole sequence's next-token labels at the shard's positions (the shard's own
    ``labels[..., 1:]`` and the next shard's first label; the last shard's last position has none), as
    a shifting Hugging Face loss given ``shift_labels`` counts them. Counting the shard's own shift
    instead would drop one label per shard boundary: wrong weights, silently. A mapping batch that
    carries ``shift_labels`` (:func:`with_shift_labels` gave them before the split) is counted from
    them; otherwise the labels are shifted across the shards (one all-gather of the group, which every
    rank of the group calls alike: they count the same micro-batches in the same order).

    Example::

        count = ShardLabelledTokens(labelled_tokens(1, shift=True), sp_group)
        count((ids_shard, labels_shard))   # this shard's labelled next-token targets
    """

    count: LabelledTokens
    group: Any

    def __call__(self, batch: Any) -> torch.Tensor:
        ignore = self.count.ignore_index
        if isinstance(batch, Mapping) and torch.is_tensor(batch.get("shift_labels")):
            return count_labelled(batch["shift_labels"], ignore)
        labels = self.count.labels(batch)
        return count_labelled(shift_across_shards(labels, self.group, ignore), ignore)


def shifts_labels(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face model whose loss shifts its ``labels`` (its ``loss_type``).

    Example::

        >>> shifts_labels(nn.Linear(2, 2))
        False
    """
    base = getattr(module, "get_base_model", None)  # a peft model counts as the model it wraps
    return getattr(base() if callable(base) else module, "loss_type", None) in _SHIFTING


def labels_unshifted(batch: Any) -> bool:
    """Whether a batch (a dict, or a mapping such as a tokenizer's ``BatchEncoding``) carries ``labels``
    without the ``shift_labels`` a shifting loss would use instead.

    Example::

        >>> labels_unshifted({"input_ids": 0, "labels": 0})
        True
        >>> labels_unshifted({"labels": 0, "shift_labels": 0})
        False
    """
    return isinstance(batch, Mapping) and "labels" in batch and "shift_labels" not in batch


def with_shift_labels(batch: Any, ignore_index: int = IGNORE_INDEX) -> Any:
    """A mapping batch whose ``labels`` a shifting loss would shift, given ``shift_labels`` (``labels[:,
    1:]`` then ``ignore_index``: the whole sequence's next-token labels, made before the batch is split,
    as ALST's loader does); anything else as it is. A copy of the same mapping type (a tokenizer's
    ``BatchEncoding`` stays one); the user's batch is not changed.

    Example::

        >>> with_shift_labels({"labels": torch.tensor([[1, 2, 3]])})["shift_labels"].tolist()
        [[2, 3, -100]]
    """
    if not labels_unshifted(batch) or not torch.is_tensor(batch["labels"]) or batch["labels"].dim() < 2:
        return batch
    labels = batch["labels"]
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    batch = copy.copy(batch)
    batch["shift_labels"] = shifted
    return batch


def group_labels(
    kwargs: dict[str, Any], group: Any, over_group: bool = True, ignore_index: int = -100
) -> dict[str, Any]:
    """A causal LM call's keywords with the group's view of its ``labels=``: ``shift_labels`` (shifted
    across the shards, :func:`shift_across_shards`) and ``num_items_in_batch``, unless given.

    ``over_group``: the count is the group's labelled tokens (one more all-reduce), so the loss is this
    shard's sum over it and the group's losses add up to one device's mean; otherwise it is this shard's
    own count, at least 1, so the loss is the shard's mean, or 0 (not NaN) on a shard without a
    labelled token, for a caller that weights each shard by its count itself (``ItemWindow``). A call without
    ``labels`` is returned as it is. Collectives: every rank of the group calls it alike.

    Example::

        kwargs = group_labels({"input_ids": ids_shard, "labels": labels_shard}, sp_group)
        hf_model(**kwargs).loss   # summed over the group: the mean over every labelled token
    """
    labels = kwargs.get("labels")
    if labels is None:
        return kwargs
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        shifted = shift_across_shards(labels, group, ignore_index)
    items = kwargs.get("num_items_in_batch")
    if items is None:
        items = (shifted != ignore_index).sum()
        if over_group:
            items = items.to(collective_device(group))
            dist.all_reduce(items, group=group)
        else:
            items = items.clamp(min=1)
    return {**kwargs, "shift_labels": shifted, "num_items_in_batch": items}


def pass_group_labels(module: nn.Module, group: Any, ignore_index: int = -100) -> RemovableHandle:
    """Give each ``labels=`` call of a Hugging Face causal LM its :func:`group_labels` (over the group).

    Its loss is then this shard's sum over the group's labelled tokens: summed over the group, one
    device's mean, and a shard without a labelled token adds 0, not NaN. Two small collectives in
    each such call.

    Returns:
        The hook's handle: ``.remove()`` undoes it.

    Raises:
        ValueError: ``module`` is not a model whose loss shifts its labels.

    Example::

        handle = pass_group_labels(hf_model, sp_group)
        loss = hf_model(input_ids=ids_shard, labels=labels_shard).loss   # summed over the group: the mean
    """
    if not shifts_labels(module):
        raise ValueError(
            f"{type(module).__name__} does not shift its labels (no Hugging Face causal-LM loss_type): "
            "its targets are split as they are"
        )

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, group_labels(kwargs, group, over_group=True, ignore_index=ignore_index)

    return module.register_forward_pre_hook(hook, with_kwargs=True)
