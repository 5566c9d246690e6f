"""Losses that are the mean over an optimizer step's items (labelled tokens), as one device computes them.

A fine-tuning loss is a mean over the batch's labelled tokens (``ignore_index=-100`` drops prompts and
padding). Averaging such means over micro-batches, accumulated batches or data-parallel replicas is not
the mean over their tokens: ``(x1/n1 + x2/n2) / 2 != (x1 + x2) / (n1 + n2)``. What one device computes
on the whole global batch is ``sum of token losses / number of labelled tokens``. Here (as Megatron's
``calculate_per_token_loss`` does) each micro-batch's (or batch's) mean loss is weighted by its item
count ``n_i`` over a reference count, so the window's gradients add up to the sum of token-loss
gradients over that reference; once per optimizer step, after the data-parallel reduction, they are
scaled by ``reference x replicas / items in the step over every replica``. The item counts of each batch
are summed over the replicas when the batch starts (one scalar all-reduce), no batch is read ahead, and
the reference (the items of the step's first batch, per replica) keeps the values in the usual range.

Example::

    window = ItemWindow()
    reference = window.add_batch(torch.tensor(37.0), group=None)   # this batch's labelled tokens
    loss = token_mean_loss * (37.0 / reference)                    # what backward sees
    ...                                                            # more batches, then the reduction
    scale_gradients(params, window.gradient_factor(replicas=1))    # the step's token mean, exactly
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_parallel.distributed.agree import collective_device, distributed_ready, world_size
from lightning_parallel.distributed.dtensors import local
from lightning_parallel.distributed.tensors import all_reduce_coalesced

ItemCount = Callable[[Any], "torch.Tensor | int | float"]

# Hugging Face heads whose loss is a token mean over labels != -100: shifted (causal) or not.
_SHIFTED = ("ForCausalLM", "ForConditionalGeneration")
_UNSHIFTED = ("ForMaskedLM", "ForTokenClassification")


def labelled_tokens(key: str | int = "labels", ignore_index: int = -100, shift: bool = False) -> ItemCount:
    """A count function for :class:`~lightning_parallel.TokenWeightedLoss`: the labels that are not ignored.

    The function can be pickled, so it travels to the ranks of a spawn launch (``strategy="ddp_spawn"``,
    ``start_method="spawn"``) with the callback that holds it.

    Args:
        key: where the labels are in a batch: a dict key (``"labels"``) or a tuple/list index (``1``
            for ``(x, y)`` batches).
        ignore_index: the label the loss ignores (``F.cross_entropy``'s default, -100).
        shift: count ``labels[..., 1:]``, as a causal LM does that shifts its labels itself (a Hugging
            Face model given ``labels=input_ids``); ``False`` when your targets are shifted already.

    Example::

        >>> count = labelled_tokens("labels")
        >>> int(count({"labels": torch.tensor([[-100, 3, 4], [-100, -100, 5]])}))
        3
        >>> int(labelled_tokens(1, shift=True)((None, torch.tensor([[1, 2, -100]]))))
        1
        >>> labelled_tokens("labels", shift=True)
        labelled_tokens('labels', ignore_index=-100, shift=True)
    """
    return LabelledTokens(key, ignore_index, shift)


@dataclass(frozen=True)
class LabelledTokens:
    """What :func:`labelled_tokens` returns: a class, not a closure, so that it pickles (and so that
    sequence parallelism can recognise a shifted count: ``techniques/sequence_parallel/labels.py``)."""

    key: str | int
    ignore_index: int
    shift: bool

    def __call__(self, batch: Any) -> torch.Tensor:
        return count_labelled(self.labels(batch), self.ignore_index, self.shift)

    def labels(self, batch: Any) -> torch.Tensor:
        """The batch's labels (``batch[key]``), a tensor."""
        labels = batch[self.key]
        if not torch.is_tensor(labels):
            raise TypeError(f"{self!r}: batch[{self.key!r}] is a {type(labels).__name__}, not a tensor")
        return labels

    def __repr__(self) -> str:
        return f"labelled_tokens({self.key!r}, ignore_index={self.ignore_index}, shift={self.shift})"


def count_labelled(labels: torch.Tensor, ignore_index: int = -100, shift: bool = False) -> torch.Tensor:
    """How many of ``labels`` (``labels[..., 1:]`` with ``shift``) are not ``ignore_index``."""
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


def hugging_face_count(module: nn.Module, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The items a Hugging Face model's own loss averages over for a call with these keywords, or None.

    A ``*ForCausalLM`` model called with ``labels=`` (or ``shift_labels=``) returns the mean over the
    shifted labels that are not -100 (``transformers.loss.ForCausalLMLoss``); ``*ForMaskedLM`` and
    ``*ForTokenClassification`` over the labels as they are. Other heads (classification: a mean over
    samples) and calls without labels: None. A ``peft`` model counts as the model it wraps. Duck-typed
    (``loss_type``, ``get_base_model``): neither transformers nor peft is imported.
    """
    base = getattr(module, "get_base_model", None)
    loss_type = getattr(base() if callable(base) else module, "loss_type", None)
    labels = kwargs.get("shift_labels")
    shift = False
    if labels is None:
        labels, shift = kwargs.get("labels"), loss_type in _SHIFTED
    if not torch.is_tensor(labels) or loss_type not in (*_SHIFTED, *_UNSHIFTED):
        return None
    return count_labelled(labels, -100, shift)


class ItemWindow:
    """The items of the batches since the last optimizer step, summed over the data-parallel replicas.

    Every rank of the step calls :meth:`add_batch` once per batch, in the same order (it all-reduces),
    and :meth:`gradient_factor` once per optimizer step.
    """

    def __init__(self) -> None:
        self.reference: float | None = None  # items per replica of the window's first batch
        self.total = 0.0  # items of the window so far, over every replica
        self.batches = 0

    def add_batch(self, items: torch.Tensor | float, group: Any, copies: int = 1) -> float:
        """Add a batch of ``items`` on this rank; returns the window's reference count.

        ``items`` are summed over ``group`` (``None``: no process group, one replica) and divided by
        ``copies``, the ranks of ``group`` that hold the same batch (tensor- or pipeline-parallel peers
        under a world group), giving the batch's items over every replica.
        """
        total = torch.as_tensor(items, dtype=torch.float64).reshape(1)
        replicas = 1
        if group is not None and distributed_ready():
            total = total.to(collective_device(group))
            all_reduce_coalesced([total], group)
            replicas = max(1, world_size(group) // copies)
        batch_items = float(total.item()) / copies
        if self.reference is None:
            self.reference = max(batch_items / replicas, 1.0)
        self.total += batch_items
        self.batches += 1
        return self.reference

    def loss_weight(self, items: float) -> float:
        """What a mean loss over ``items`` is multiplied by before backward (its items over the reference)."""
        if self.reference is None:
            raise RuntimeError("internal error: ItemWindow.loss_weight before add_batch")
        return items / self.reference

    def gradient_factor(self, replicas: int) -> float:
        """The factor that turns the reduced (replica-averaged) gradients into the step's token mean.

        Ends the window: the next :meth:`add_batch` starts a new one.
        """
        factor = 1.0 if self.reference is None else self.reference * replicas / max(self.total, 1.0)
        self.reference, self.total, self.batches = None, 0.0, 0
        return factor


def scale_gradients(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient of ``params`` by ``factor`` (a sharded gradient: its local shard)."""
    if factor == 1.0:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
