"""Plain data-parallel replicas (``data_parallel="replicate"``, and ZeRO-1's replicas too): every gradient no
other reduction finished averaged over the stage's data-parallel ranks, once per optimizer step.

One coalesced all-reduce per dtype after the window's last backward (:func:`~lightning_parallel.grads.
reduce.all_reduce_gradients`), never one per micro-batch; a tensor-parallel (DTensor) gradient averages
its local slice. FSDP2's roots reduce-scatter their own (they run before, and this skips them). For the
planner: that all-reduce, after the schedule (:meth:`Replicas.time`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from lightning_parallel.grads.reduce import all_reduce_gradients
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.job import Job, Reduction
from lightning_parallel.techniques.ledgers import TimeLedger


class Replicas(Technique):
    """The replicas' all-reduce: what every stage's data-parallel ranks finish with.

    Example::

        [average] = TECHNIQUE.reductions(job)
        average(finished=fsdp_params)       # once per optimizer step
    """

    name = "replicas"

    def reductions(self, job: Job) -> list[Reduction]:
        return [Average(job.module, job.mesh.group("gradients"))]

    def time(self, ledger: TimeLedger) -> None:
        """One all-reduce (one coalesced message) of the gradients no reduction before it finished, over
        the ``"gradients"`` role's ranks (the replicas x the sequence ranks, which join it)."""
        if ledger.unreduced > 0:
            ledger.tail["communication"] += ledger.links.all_reduce(
                ledger.plan.layout().size("gradients"), ledger.unreduced
            )
            ledger.unreduced = 0.0


TECHNIQUE = Replicas()


class Average(Reduction):
    """The gradients of ``module``'s parameters averaged over ``group``, but those already finished.

    Example::

        Average(module, mesh.group("gradients"))(finished=())
    """

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.module, self.group = module, group

    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        all_reduce_gradients(self.module.parameters(), self.group, skip=finished)
