"""One optimizer step's gradient synchronisation: the tied weights' sum, the techniques' reductions, the
token scaling.

Once per optimizer step, after the window's last backward and before clipping and the step itself:

1. the reductions that leave their gradients on shards (FSDP2 stages reduce-scatter the whole
   accumulation window's gradients: one reduce-scatter, not one per micro-batch or per batch);
2. the replicas of a tied weight (an embedding and the head on two stages) sum their gradients (the
   pipeline's own: tied weights are no technique; sharded replicas sum their shards);
3. the other reductions, in the techniques' order: every gradient not finished yet averaged over the
   stage's data-parallel ranks (plain replicas and ZeRO-1);
4. with token-exact losses, the gradients are scaled to the step's mean over its items (every batch of
   the window, every replica: :class:`~lightning_parallel.grads.item_weights.ItemWindow`).

The reductions come from the techniques (``Technique.reductions``, folded at set-up); each knows the
parameters it finishes, and those after it leave them alone. Where the optimizer state lives elsewhere
(offload to the host), the step's gradients leave the device after this, once per step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from lightning_parallel.grads.item_weights import ItemWindow, scale_gradients
from lightning_parallel.grads.tied import SharedReplicas


class GradientReduction(Protocol):
    """What :class:`GradientSync` runs (``techniques/contract.py``'s ``Reduction``): called with the
    parameters the reductions before it finished; ``params``: those it finishes."""

    params: Collection[torch.Tensor]
    before_tied_sum: bool

    def __call__(self, finished: Collection[torch.Tensor]) -> None: ...


@dataclass
class GradientSync:
    """What this rank's optimizer step synchronises, decided once at setup from the plan and the split.

    Args:
        module: the LightningModule (its parameters are this rank's stages').
        shared: the tied weights' replicas on this rank.
        reductions: the techniques' gradient reductions, in the techniques' order.
        replicas: the ranks the gradients are averaged over (``mesh.size("gradients")``): the token
            scaling undoes that mean.
        items: the window of counted items (token-exact losses), or ``None`` (sample-weighted).

    Example::

        reductions = [r for t in TECHNIQUES for r in t.reductions(job)]
        sync = GradientSync(module, parts.shared, reductions, mesh.size("gradients"))
        sync()       # in optimizer_step's closure, after Lightning's backward
    """

    module: nn.Module
    shared: SharedReplicas
    reductions: Sequence[GradientReduction]
    replicas: int
    items: ItemWindow | None = None

    def background_spans(self) -> list[tuple[str, int, int]]:
        """What the reductions ran beside the last step's compute (``Reduction.spans``), for the timeline."""
        return [span for reduction in self.reductions for span in getattr(reduction, "spans", ())]

    def __call__(self) -> None:
        finished: list[torch.Tensor] = []
        for reduction in (r for r in self.reductions if r.before_tied_sum):
            reduction(finished)
            finished += reduction.params
        self.shared.sum_gradients()
        for reduction in (r for r in self.reductions if not r.before_tied_sum):
            reduction(finished)
            finished += reduction.params
        if self.items is not None:
            scale_gradients(self.module.parameters(), self.items.gradient_factor(self.replicas))
