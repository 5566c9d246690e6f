"""Lightning's collectives called from the user's step (``self.all_gather``, ``strategy.reduce`` ...),
routed to the ranks that can meet there.

Only the stage running the step's code reaches a collective in it: its data-parallel ranks (the last
stage's, after the model call). The default (world) group there means those ranks; a collective over
other ranks is refused on every rank by the step scope (:mod:`lightning_parallel.pipeline.step_scope`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_parallel.distributed.collectives import barrier, broadcast_object


class StepCollectives:
    """A mixin of ``PipelineStrategy``: its ``all_gather``, ``reduce``, ``barrier`` and ``broadcast``.

    Reads the strategy's ``parts`` (this rank's pipeline). Example: in a ``validation_step``,
    ``self.all_gather(preds)`` gathers over the last stage's replicas.
    """

    parts: Any

    def _step_group(self, group: Any) -> Any:
        """In the user's step, the default (world) group means the ranks the step meets (its ``"step"``
        role: the data-parallel ranks of the stage running it)."""
        parts = self.parts
        if parts is None or not parts.scope.active or not (group is None or group is dist.group.WORLD):
            return group
        return parts.mesh.group("step")

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return super().all_gather(tensor, group=self._step_group(group), sync_grads=sync_grads)  # type: ignore[misc]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        group = self._step_group(group)
        if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) == 1:
            return tensor  # any reduction over one rank is the value itself (a replica group of one rank)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        group = self._step_group(None)
        if group is None:
            return super().barrier(*args, **kwargs)  # type: ignore[misc]
        barrier(group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        group = self._step_group(None)
        if group is None:
            return super().broadcast(obj, src)  # type: ignore[misc]
        return broadcast_object(obj, src=dist.get_global_rank(group, src), group=group)
