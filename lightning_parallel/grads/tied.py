"""Parameters used by several pipeline stages (tied weights): one replica per rank, kept bit-identical.

A weight tied between the embedding and the head (``lm_head.weight is wte.weight``) is used by the
first and the last stage. Every pipeline rank whose stages use it keeps a replica; the replicas start
from the owner's values (the lowest pipeline rank among them), and after backward their gradients
are summed over exactly the ranks that hold them, so every replica takes the same update. Stages on one
rank share one tensor, as in the unsplit module. Gradient-norm clipping counts the weight once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_parallel.distributed.dtensors import local
from lightning_parallel.distributed.tensors import all_reduce_coalesced, broadcast_coalesced
from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.pipeline.plan import stage_rank


@dataclass(frozen=True)
class SharedParameter:
    """A parameter that stages on more than one pipeline rank use."""

    name: str
    stages: tuple[int, ...]
    pp_ranks: tuple[
        int, ...
    ]  # ascending; the first one owns it (its values win at start, it counts the norm)


def find_shared(
    stage_parameters: Sequence[Iterable[str]], pp_size: int, style: str = "loop"
) -> list[SharedParameter]:
    """The canonical parameters used by stages on several pipeline ranks (placed by :func:`stage_rank`).

    Example::

        >>> find_shared([{"wte.weight", "h.0.w"}, {"h.1.w", "wte.weight"}], pp_size=2)
        [SharedParameter(name='wte.weight', stages=(0, 1), pp_ranks=(0, 1))]
    """
    users: dict[str, list[int]] = {}
    for stage, names in enumerate(stage_parameters):
        for name in names:
            users.setdefault(name, []).append(stage)
    shared = []
    for name, stages in sorted(users.items()):
        ranks = tuple(sorted({stage_rank(s, pp_size, len(stage_parameters), style) for s in stages}))
        if len(ranks) > 1:
            shared.append(SharedParameter(name, tuple(stages), ranks))
    return shared


class SharedReplicas:
    """This rank's replicas of the shared parameters, and the groups of ranks that hold each.

    Building it is a collective (every rank creates every group, in the same order). Then
    :meth:`broadcast_from_owners` once at setup and :meth:`sum_gradients` once per optimizer step,
    before the replica all-reduce and clipping.

    Example::

        replicas = SharedReplicas(find_shared(stage_params, pp_size), mesh, dict(module.named_parameters()))
        replicas.broadcast_from_owners()
        ...
        replicas.sum_gradients()        # one all-reduce per set of holding ranks (usually one)
    """

    def __init__(
        self, shared: Sequence[SharedParameter], mesh: PipelineMesh, local: Mapping[str, nn.Parameter]
    ) -> None:
        self.shared = list(shared)
        self._groups: list[
            tuple[object, int, list[nn.Parameter]]
        ] = []  # (group, owner's global rank, params)
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for p in self.shared:
            by_ranks.setdefault(p.pp_ranks, []).append(p.name)
        for pp_ranks, names in sorted(by_ranks.items()):
            # One group per pipeline (each data- and tensor-parallel coordinate runs its own).
            replicas = [[pipeline[r] for r in pp_ranks] for pipeline in mesh.layout.groups("pipeline")]
            group = mesh.new_groups(replicas)
            if mesh.pp_rank in pp_ranks:
                params = [local[n] for n in names]
                self._groups.append((group, mesh.global_rank(pp_ranks[0]), params))
        self.not_counted = [
            local[p.name] for p in self.shared if p.pp_ranks[0] != mesh.pp_rank and p.name in local
        ]

    def broadcast_from_owners(self) -> None:
        """Give every replica the owner's values (ranks may have initialised them differently)."""
        with torch.no_grad():
            for group, owner, params in self._groups:
                broadcast_coalesced([local(p.data) for p in params], owner, group)

    def sum_gradients(self) -> None:
        """Sum the replicas' gradients over the ranks that hold them: every replica takes the same step."""
        for group, _, params in self._groups:
            for p in params:
                if p.grad is None:  # this rank's stages did not reach it in this step: contribute zero
                    p.grad = torch.zeros_like(p)
            # A sharded replica sums its local shard: the tied replicas are sharded alike.
            all_reduce_coalesced([local(p.grad) for p in params], group)

    def rebound(self, new: Mapping[int, nn.Parameter]) -> SharedReplicas:
        """These replicas, following parameters that were replaced (``id(old) -> new``: FSDP swaps in
        DTensor parameters); the same groups."""
        rebound = copy.copy(self)
        rebound._groups = [
            (g, owner, [new.get(id(p), p) for p in params]) for g, owner, params in self._groups
        ]
        rebound.not_counted = [new.get(id(p), p) for p in self.not_counted]
        return rebound
