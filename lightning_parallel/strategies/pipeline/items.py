"""How PipelineStrategy counts a batch's items (labelled tokens) for token-exact losses, and counts them.

Two sources, picked once at setup (see :mod:`lightning_parallel.grads.item_weights`):

* a count function the user gave (``TokenWeightedLoss(count=...)``), applied to each micro-batch of
  the batch as the schedule splits it;
* the pipelined call's own labels, when it is a Hugging Face model whose loss is a token mean
  (``self.model(..., labels=y).loss``): automatic, counted as that loss counts them.

Without either, micro-batches are weighted by their samples, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_parallel.grads.item_weights import ItemCount, ItemWindow, hugging_face_count
from lightning_parallel.pipeline.microbatches import split_microbatches
from lightning_parallel.pipeline.proxy import PipelinedCall


@dataclass
class StepItems:
    """What a training step counts as its items, and the window of batches counted since the last step.

    Args:
        count: the user's count function of a (micro-)batch, or None.
        call_target: the module the pipelined call goes to, when its labels are counted (a Hugging
            Face model's loss), or None.
    """

    count: ItemCount | None = None
    call_target: nn.Module | None = None
    window: ItemWindow = field(default_factory=ItemWindow)

    @property
    def from_call(self) -> bool:
        """Whether the items are read from the pipelined call's arguments (so every rank captures them)."""
        return self.count is None and self.call_target is not None

    def per_microbatch(
        self, chunks: Sequence[Any], call_args: tuple[Any, ...] | None, call: PipelinedCall
    ) -> list[float] | None:
        """The items of each micro-batch: from the batch's ``chunks``, or the call's tensors split alike.

        None where the call counts none (an evaluation step that passes no ``labels``).
        """
        if self.count is not None:
            counts = [self.count(chunk) for chunk in chunks]
        else:
            if call_args is None or self.call_target is None:
                raise RuntimeError("internal error: items counted from a call that was not captured")
            split = split_microbatches(call_args, len(chunks))  # as the schedule splits the call
            counts = [hugging_face_count(self.call_target, call.keywords(c)) for c in split]
            if any(c is None for c in counts):
                return None
        return torch.stack([torch.as_tensor(c).reshape(()).double().cpu() for c in counts]).tolist()


def step_items(module: nn.Module, call: PipelinedCall, count: ItemCount | None) -> StepItems | None:
    """How this strategy's training steps count items: the user's ``count``, the call's labels, or None."""
    if count is not None:
        return StepItems(count=count)
    target = call.target(module)
    if target is None or hugging_face_count(target, call.keywords()) is None:
        return None
    return StepItems(call_target=target)
