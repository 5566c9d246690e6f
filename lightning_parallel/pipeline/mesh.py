"""Where pipeline ranks and data-parallel replicas sit among the global ranks, and their process groups.

Vocabulary used throughout the package:

* a **stage** is one contiguous part of the model (``stages`` of a plan, ``stage_index``);
* a **pipeline rank** runs one or more stages (``stages_per_rank``); ``pp_size`` pipeline ranks form
  one pipeline (``PipelineStrategy(pipeline_size=...)``);
* a **replica** (``dp_rank``) is one whole pipeline; ``dp_size`` replicas train on different data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@dataclass(frozen=True)
class RankLayout:
    """The (pipeline rank, replica) grid laid out pipeline-outermost, as torchtitan does.

    Global rank = ``pp_rank x dp_size + dp_rank``: the replicas of one pipeline rank, whose gradient
    all-reduce is the heavy traffic, are neighbours (the same node when they fit), and global rank 0
    holds the first stage of replica 0.

    Example::

        layout = RankLayout(pp_size=2, dp_size=2)
        layout.global_rank(1, 0), layout.coordinates(3)     # 2, (1, 1)
    """

    pp_size: int
    dp_size: int

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp_size + dp_rank

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of a global rank."""
        return divmod(global_rank, self.dp_size)

    def replicas_of(self, pp_rank: int) -> tuple[int, ...]:
        """The global ranks that run pipeline rank ``pp_rank``, one per replica."""
        return tuple(self.global_rank(pp_rank, d) for d in range(self.dp_size))

    @classmethod
    def for_world(cls, world_size: int, pp_size: int) -> RankLayout:
        """The layout of ``world_size`` ranks in pipelines of ``pp_size``, or a clear error."""
        if world_size % pp_size:
            lower = world_size - world_size % pp_size
            raise ValueError(
                f"pipeline_size ({pp_size}) does not divide devices x nodes ({world_size}): use a multiple "
                f"of {pp_size} devices (e.g. {max(lower, pp_size)} or {lower + pp_size}), or change "
                f"pipeline_size"
            )
        return cls(pp_size, world_size // pp_size)


@dataclass
class PipelineMesh:
    """This rank's place in the layout and the two process groups it belongs to.

    ``pp_group`` links the pipeline ranks of one replica (activations flow through it); ``dp_group``
    links the replicas of one pipeline rank (its gradients are all-reduced over it).

    Example::

        mesh = build_mesh("cpu", RankLayout(pp_size=2, dp_size=2))   # 4 ranks
        mesh.is_last_pipeline_rank, mesh.dp_group
    """

    layout: RankLayout
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def is_last_pipeline_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of ``pp_rank`` in this rank's replica (or in replica ``dp_rank``)."""
        return self.layout.global_rank(pp_rank, self.dp_rank if dp_rank is None else dp_rank)


def build_mesh(device_type: str, layout: RankLayout) -> PipelineMesh:
    """Create the pipeline and replica groups; every rank must call it (it is a collective)."""
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise RuntimeError("build_mesh needs an initialised process group for more than one rank")
        return PipelineMesh(layout, 0, 0, None, None)
    # init_device_mesh numbers its grid row-major, which is RankLayout's pipeline-outermost order.
    mesh = init_device_mesh(device_type, (layout.pp_size, layout.dp_size), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = layout.coordinates(dist.get_rank())
    return PipelineMesh(layout, pp_rank, dp_rank, mesh["pp"].get_group(), mesh["dp"].get_group())
