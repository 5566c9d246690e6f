"""Pipeline x data-parallel process groups, from an initialised default process group."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class PipelineMesh:
    """This rank's place in the (pp, dp) grid and the two process groups it belongs to.

    ``pp_group`` links the stages of one replica (activations flow through it); ``dp_group`` links the
    replicas of one stage (its gradients are all-reduced over it).

    Example::

        mesh = build_mesh("cpu", pp_size=2, dp_size=2)   # 4 ranks
        mesh.is_last_stage, mesh.dp_group
    """

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device_mesh: DeviceMesh | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of ``pp_rank`` in this rank's replica (or in replica ``dp_rank``)."""
        return pp_rank * self.dp_size + (self.dp_rank if dp_rank is None else dp_rank)


def check_world(world_size: int, num_stages_per_replica: int) -> int:
    """Data-parallel size for this world size, or a clear error when the grid does not fit."""
    if world_size % num_stages_per_replica:
        lower = world_size - world_size % num_stages_per_replica
        raise ValueError(
            f"num_stages ({num_stages_per_replica}) does not divide devices x nodes ({world_size}): use a "
            f"multiple of {num_stages_per_replica} devices (e.g. {max(lower, num_stages_per_replica)} or "
            f"{lower + num_stages_per_replica}), or change num_stages"
        )
    return world_size // num_stages_per_replica


def build_mesh(device_type: str, pp_size: int, dp_size: int) -> PipelineMesh:
    """Create the (pp, dp) groups; every rank must call it (it is a collective)."""
    if not dist.is_initialized():
        if pp_size * dp_size != 1:
            raise RuntimeError("build_mesh needs an initialised process group for more than one rank")
        return PipelineMesh(1, 1, 0, 0, None, None)
    mesh = init_device_mesh(device_type, (pp_size, dp_size), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = divmod(dist.get_rank(), dp_size)
    return PipelineMesh(
        pp_size, dp_size, pp_rank, dp_rank, mesh["pp"].get_group(), mesh["dp"].get_group(), mesh
    )
