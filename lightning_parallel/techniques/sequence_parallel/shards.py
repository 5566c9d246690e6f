"""A batch split over the ranks of a sequence-parallel group: each takes one contiguous shard of tokens.

The ``k`` ranks of a group read the same batch; :func:`shard_batch` gives rank ``index`` tokens
``index*t .. (index+1)*t - 1`` (``t = T/k``) of every per-token tensor of it, everything else whole.
How it finds the sequence: ``T`` is dimension ``seq_dim`` (1) of the batch's first tensor with one (the
input ids come first in ``(x, y)`` and ``{"input_ids": ...}`` batches alike); every tensor whose
``seq_dim`` has that size is split (ids, targets, labels, masks, ``position_ids``), the others (a
per-sample label, a tensor of another length) stay whole. Targets the data shifted already (``y[t] =
x[t+1]``) stay right when split; a model that shifts its ``labels=`` itself gets its boundary labels from
:mod:`.labels`. The shards are contiguous tensors (Hugging Face's loss calls ``view`` on its labels).

A dict batch's ``attention_mask`` (``masks``) of right padding is replaced by ones, where that is exact:
under causal attention no labelled token sees the padding after it, and the padded positions must be
unlabelled (checked against ``labels``); left padding or holes are refused (:mod:`.masks` says why).
These decisions read the whole batch, which every rank of the group holds: they agree without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["joined_shards", "sequence_length", "shard_batch"]


def shard_batch(
    batch: Any,
    index: int,
    size: int,
    seq_dim: int = 1,
    masks: Sequence[str] = ("attention_mask",),
    labels: str = "labels",
    ignore_index: int = -100,
) -> Any:
    """Shard ``index`` of ``size`` of every per-token tensor of ``batch`` (nested dicts, tuples, lists).

    Args:
        batch: the batch every rank of the group holds.
        index: this rank's shard (its rank in the sequence-parallel group).
        size: the group's size ``k``; it must divide the sequence length.
        seq_dim: the sequence dimension.
        masks: the keys of a dict batch's padding masks (right padding is replaced by ones).
        labels: the key of a dict batch's labels (their padded positions must be ``ignore_index``).
        ignore_index: the label the loss ignores.

    Raises:
        ValueError: the length is not a multiple of ``size`` (the message names ``pad_to_multiple``), a
            mask pads on the left or has holes, or padded positions carry labels.
        TypeError: no tensor of the batch has a dimension ``seq_dim``.

    Example::

        >>> batch = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8)}
        >>> shard_batch(batch, index=1, size=2)["input_ids"].tolist()
        [[4, 5, 6, 7]]
    """
    length = sequence_length(batch, seq_dim)
    if length % size:
        raise ValueError(
            f"sequence_parallel_size={size} splits each sequence into {size} equal shards, but this batch's "
            f"sequences are {length} tokens long (dimension {seq_dim} of its first tensor): pad them to a "
            f"multiple of {size} in the DataLoader, collate_fn=lightning_parallel.padding_to_multiple("
            f"collate_fn, {size}, {{'{labels}': {ignore_index}}}) (or lightning_parallel.pad_to_multiple on "
            "a batch)"
        )
    if isinstance(batch, Mapping):
        batch = _without_right_padding(batch, masks, labels, ignore_index, seq_dim)
    t = length // size

    def shard(x: torch.Tensor) -> torch.Tensor:
        if x.dim() <= seq_dim or x.shape[seq_dim] != length:
            return x
        return x.narrow(seq_dim, index * t, t).contiguous()

    return _map_tensors(batch, shard)


def joined_shards(outputs: Sequence[Any], length: int, seq_dim: int = 1, where: str = "output") -> Any:
    """The group's outputs of one step (shard 0 first) joined in token order: :func:`shard_batch` undone.

    Each tensor with ``length`` (one shard's tokens) on ``seq_dim`` is concatenated there; any other
    value must be the same on every shard (it is kept once), else it is refused: a value computed from one
    shard's tokens (a per-sample mean, a count) is not the whole sequence's, and nothing can join it.

    Raises:
        ValueError: a value without the token dimension differs between the shards (named by its path).

    Example::

        >>> a, b = {"logits": torch.zeros(1, 2, 3)}, {"logits": torch.ones(1, 2, 3)}
        >>> joined_shards([a, b], length=2)["logits"][0, :, 0].tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    first = outputs[0]
    if torch.is_tensor(first):
        if first.dim() > seq_dim and first.shape[seq_dim] == length:
            return torch.cat([o.to(first.device) for o in outputs], dim=seq_dim)
        if all(torch.equal(first, o.to(first.device)) for o in outputs[1:]):
            return first
    elif isinstance(first, Mapping):
        return type(first)(
            {k: joined_shards([o[k] for o in outputs], length, seq_dim, f"{where}[{k!r}]") for k in first}
        )
    elif isinstance(first, tuple | list):
        joined = [
            joined_shards([o[i] for o in outputs], length, seq_dim, f"{where}[{i}]")
            for i in range(len(first))
        ]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    elif all(o == first for o in outputs[1:]):
        return first
    raise ValueError(
        f"sequence parallelism: the predict_step's {where} differs between the {len(outputs)} shards of the "
        f"sequence and has no token dimension ({seq_dim}, of {length} tokens a shard) to join them on. Each "
        "rank sees only its shard's tokens: return per-token values (logits, ids) from predict_step and "
        "reduce them after the prediction"
    )


def sequence_length(batch: Any, seq_dim: int = 1) -> int:
    """Dimension ``seq_dim`` of the first tensor of ``batch`` that has one.

    Raises:
        TypeError: none has.

    Example::

        >>> sequence_length((torch.zeros(2, 6), torch.zeros(2)))
        6
    """
    found: list[int] = []
    _map_tensors(batch, lambda x: found.append(x.shape[seq_dim]) or x if x.dim() > seq_dim else x)
    if not found:
        raise TypeError(
            f"sequence parallelism splits a batch's tensors on dimension {seq_dim}, and this batch has no "
            f"tensor with {seq_dim + 1} dimensions or more"
        )
    return found[0]


def _without_right_padding(
    batch: Mapping[str, Any], masks: Sequence[str], labels: str, ignore_index: int, seq_dim: int
) -> Mapping[str, Any]:
    """``batch`` with each right-padding mask of ``masks`` replaced by ones; other padding refused."""
    out = dict(batch)
    for key in masks:
        mask = batch.get(key)
        if not torch.is_tensor(mask) or bool(mask.bool().all()):
            continue
        kept = mask.bool().movedim(seq_dim, -1)
        if bool((kept[..., 1:] & ~kept[..., :-1]).any()):  # a kept token after a padded one
            raise ValueError(
                f"sequence parallelism needs right padding: batch[{key!r}] pads before some tokens (left "
                "padding, or holes), which causal attention over the whole sequence cannot express. Pad on "
                "the right (a tokenizer's padding_side='right'), with labels -100 at the padding"
            )
        target = batch.get(labels)
        if (
            torch.is_tensor(target)
            and target.shape == mask.shape
            and bool((target[~mask.bool()] != ignore_index).any())
        ):
            raise ValueError(
                f"sequence parallelism leaves the right padding out of the attention mask, which is exact "
                f"only where the padding is not labelled: batch[{labels!r}] has labels other than "
                f"{ignore_index} where batch[{key!r}] is 0; label the padding {ignore_index}"
            )
        out[key] = torch.ones_like(mask)
    return type(batch)(out) if type(batch) is not dict else out


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to each tensor, its containers rebuilt (dicts, namedtuples, tuples,
    lists)."""
    if torch.is_tensor(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch
