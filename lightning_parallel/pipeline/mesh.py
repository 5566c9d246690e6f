"""Where pipeline ranks and data-parallel ranks sit among the global ranks: one device mesh, built once.

Vocabulary used throughout the package:

* a **stage** is one contiguous part of the model (``stages`` of a plan, ``stage_index``);
* a **pipeline rank** runs one or more stages (``stages_per_rank``); ``pp_size`` pipeline ranks form
  one pipeline (``PipelineStrategy(pipeline_size=...)``);
* a **replica** (``dp_rank``) is one whole pipeline; ``dp_size`` replicas train on different data.
  With sharded data parallelism (FSDP2) the ``dp_size`` data-parallel ranks of a stage are laid out as
  ``dp_replicate x dp_shard``: each stage's parameters are sharded over ``dp_shard`` ranks and the
  shards replicated ``dp_replicate`` times (HSDP; plain FSDP when ``dp_replicate`` is 1);
* a **tensor-parallel rank** (``tp_rank``) holds a slice of each split weight of its stage; the
  ``tp_size`` tensor-parallel ranks of one (pipeline, data-parallel) coordinate see the same data.

The torch ``DeviceMesh`` has the named dimensions of :data:`MESH_DIMS`; ``PipelineMesh.dp_mesh``
flattens replicate and shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class RankLayout:
    """The (pipeline, data-parallel, tensor-parallel) grid laid out pipeline-outermost, as torchtitan does.

    Global rank = ``(pp_rank x dp_size + dp_rank) x tp_size + tp_rank`` and ``dp_rank = replicate x
    dp_shard_size + shard``: the tensor-parallel ranks, which communicate in every layer, are
    neighbours; then the data-parallel ranks of one pipeline rank (the same node when they fit); and
    global rank 0 holds the first stage of replica 0.

    Example::

        layout = RankLayout(pp_size=2, dp_size=4, dp_shard_size=2)
        layout.global_rank(1, 0), layout.coordinates(5)     # 4, (1, 1)
        layout.mesh_shape                                   # (2, 2, 2, 1): pp, dp_replicate, dp_shard, tp
        RankLayout(pp_size=2, dp_size=1, tp_size=2).global_rank(1, 0, tp_rank=1)     # 3
    """

    pp_size: int
    dp_size: int
    dp_shard_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {self.tp_size!r}")
        if self.dp_shard_size < 1 or self.dp_size % self.dp_shard_size:
            raise ValueError(
                f"data_parallel_shard_size ({self.dp_shard_size}) does not divide the {self.dp_size} "
                f"data-parallel ranks of each stage: use a divisor of {self.dp_size}"
            )

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.tp_size

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_size // self.dp_shard_size

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Sizes of :data:`MESH_DIMS`, in order."""
        return (self.pp_size, self.dp_replicate_size, self.dp_shard_size, self.tp_size)

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        return (pp_rank * self.dp_size + dp_rank) * self.tp_size + tp_rank

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of a global rank (its tensor-parallel peers share them)."""
        return divmod(global_rank // self.tp_size, self.dp_size)

    def tp_rank_of(self, global_rank: int) -> int:
        return global_rank % self.tp_size

    def replicas_of(self, pp_rank: int) -> tuple[int, ...]:
        """The global ranks that run pipeline rank ``pp_rank`` (each data- and tensor-parallel rank)."""
        return tuple(
            self.global_rank(pp_rank, d, t) for d in range(self.dp_size) for t in range(self.tp_size)
        )

    @classmethod
    def for_world(cls, world_size: int, pp_size: int, dp_shard_size: int = 1, tp_size: int = 1) -> RankLayout:
        """The layout of ``world_size`` ranks in pipelines of ``pp_size`` x ``tp_size``, or a clear error."""
        group = pp_size * tp_size
        if world_size % group:
            lower = world_size - world_size % group
            what = "pipeline_size" if tp_size == 1 else "pipeline_size x tensor_parallel_size"
            sizes = f"{pp_size}" if tp_size == 1 else f"{pp_size} x {tp_size} = {group}"
            raise ValueError(
                f"{what} ({sizes}) does not divide devices x nodes ({world_size}): use a multiple "
                f"of {group} devices (e.g. {max(lower, group)} or {lower + group}), or change "
                f"{what}"
            )
        return cls(pp_size, world_size // group, dp_shard_size, tp_size)


@dataclass
class PipelineMesh:
    """This rank's place in the layout, the device mesh and the process groups read from it.

    ``pp_group`` links the pipeline ranks of one replica and tensor-parallel rank (activations flow
    through it); ``dp_group`` links the data-parallel ranks of one pipeline and tensor-parallel rank
    (replicate x shard: its gradients are averaged over it); ``tp_mesh`` the tensor-parallel ranks
    of one stage replica (its split weights are DTensors over it). ``device_mesh`` is the torch
    ``DeviceMesh`` with dimensions :data:`MESH_DIMS` (``None`` on a single process); ``dp_mesh`` is its
    replicate and shard dimensions flattened into one.

    Example::

        mesh = build_mesh("cpu", RankLayout(pp_size=2, dp_size=2))   # 4 ranks
        mesh.is_last_pipeline_rank, mesh.dp_group, mesh.device_mesh["dp_shard"]
    """

    layout: RankLayout
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device_mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None
    tp_rank: int = 0

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.layout.dp_shard_size

    @property
    def is_last_pipeline_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel ranks of this rank's stage replica (``None`` on a single process)."""
        return self.device_mesh["tp"] if self.device_mesh is not None else None

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of ``pp_rank`` in this rank's replica (or in data-parallel rank ``dp_rank``).

        The same tensor-parallel rank as this one: the pipeline of each tensor-parallel rank is its own.
        """
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        return self.layout.global_rank(pp_rank, dp_rank, self.tp_rank)

    def data_parallel_mesh(self) -> DeviceMesh | None:
        """The mesh a stage is sharded on: ``dp_shard`` (FSDP), or ``(dp_replicate, dp_shard)`` (HSDP)."""
        if self.device_mesh is None:
            return None
        if self.layout.dp_replicate_size > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]


def build_mesh(device_type: str, layout: RankLayout) -> PipelineMesh:
    """Create the device mesh and its groups; every rank must call it (it is a collective)."""
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise RuntimeError("build_mesh needs an initialised process group for more than one rank")
        return PipelineMesh(layout, 0, 0, None, None)
    # init_device_mesh numbers its grid row-major, which is RankLayout's pipeline-outermost order.
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    # DeviceMesh._flatten is private (torch 2.13; torchtitan flattens its dp dimensions the same way):
    # the replicate x shard ranks of this rank's stage, as one dimension.
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    rank = dist.get_rank()
    pp_rank, dp_rank = layout.coordinates(rank)
    pp_group, dp_group = mesh["pp"].get_group(), dp_mesh.get_group()
    return PipelineMesh(layout, pp_rank, dp_rank, pp_group, dp_group, mesh, dp_mesh, layout.tp_rank_of(rank))
