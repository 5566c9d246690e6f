"""One optimizer step's gradient synchronisation, as one function of the plan.

Once per optimizer step, after the window's last backward and before clipping and the step itself:

1. FSDP2 stages reduce-scatter the whole accumulation window's gradients (one reduce-scatter, not one
   per micro-batch or per batch: :mod:`~lightning_parallel.techniques.fsdp`);
2. the replicas of a tied weight (an embedding and the head on two stages) sum their gradients;
3. every other gradient is averaged over the stage's data-parallel ranks (plain replicas and ZeRO-1);
4. with token-exact losses, the gradients are scaled to the step's mean over its items (every batch of
   the window, every replica: :class:`~lightning_parallel.grads.item_weights.ItemWindow`).

Where the optimizer state lives elsewhere (offload to the host), the step's gradients leave the device
after this, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_parallel.grads.item_weights import ItemWindow, scale_gradients
from lightning_parallel.grads.reduce import all_reduce_gradients
from lightning_parallel.grads.tied import SharedReplicas
from lightning_parallel.techniques.fsdp import reduce_gradients


@dataclass
class GradientSync:
    """What this rank's optimizer step synchronises, decided once at setup from the plan and the split.

    Args:
        module: the LightningModule (its parameters are this rank's stages').
        sharded: the stage modules that are FSDP2 roots (they reduce their own gradients).
        shared: the tied weights' replicas on this rank.
        group: the stage's data-parallel ranks (``None``: one replica).
        replicas: their number.
        items: the window of counted items (token-exact losses), or ``None`` (sample-weighted).

    Example::

        sync = GradientSync(module, parts.sharded, parts.shared, mesh.dp_group, mesh.dp_size)
        sync()       # in optimizer_step's closure, after Lightning's backward
    """

    module: nn.Module
    sharded: Sequence[nn.Module]
    shared: SharedReplicas
    group: Any
    replicas: int
    items: ItemWindow | None = None

    def __call__(self) -> None:
        reduce_gradients(self.sharded)
        self.shared.sum_gradients()
        fsdp_params = [p for root in self.sharded for p in root.parameters()]
        all_reduce_gradients(self.module.parameters(), self.group, skip=fsdp_params)
        if self.items is not None:
            scale_gradients(self.module.parameters(), self.items.gradient_factor(self.replicas))
