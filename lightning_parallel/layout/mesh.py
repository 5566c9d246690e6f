"""This rank's place in the plan's rank layout: one device mesh and its process groups, built once."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel.layout.ranks import MESH_DIMS, RankLayout


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
