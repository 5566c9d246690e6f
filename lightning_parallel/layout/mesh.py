"""This rank's place in the plan's rank layout: one device mesh and its process groups, built once, asked
for by role (:data:`~lightning_parallel.layout.ranks.ROLES`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel.distributed.host_group import group_backend
from lightning_parallel.distributed.tensors import new_subgroups
from lightning_parallel.layout.ranks import ROLES, RankLayout

_FLAT_NAMES = {("dp_replicate", "dp_shard"): "dp"}
"""The name of a flattened dimension a user's ``parallelize_fn`` may read (``device_mesh["dp"]``); any
other set of axes flattens under its names joined by ``_``."""


@dataclass
class PipelineMesh:
    """This rank's place in the layout, the device mesh and the process groups of each role.

    ``group(role)`` is the process group of this rank's group of ``role`` (``"gradients"``: the ranks that
    average this stage's gradients; ``"data"``: those that read different batches; ``"pipeline"``: this
    replica's stages; every role in :data:`~lightning_parallel.layout.ranks.ROLES`), ``size(role)`` and
    ``rank(role)`` its size and this rank's place in it, ``members(role)`` its global ranks. A role's
    groups are those of the axes that join it (today every data-parallel role is the ``dp_replicate x
    dp_shard`` ranks of a stage); the code that averages gradients or counts tokens asks for its role,
    so a new axis changes none of it. ``device_mesh`` is the torch ``DeviceMesh`` whose dimensions are
    the layout's axes (``None`` on a single process). ``backend``: the backend the groups were made with
    when it is not the default group's (:func:`build_mesh`).

    Example::

        mesh = build_mesh("cpu", RankLayout(pp_size=2, dp_size=2))   # 4 ranks
        mesh.is_last_pipeline_rank, mesh.group("gradients"), mesh.size("data"), mesh.rank("data")
    """

    layout: RankLayout
    world_rank: int = 0
    device_mesh: DeviceMesh | None = None
    role_meshes: dict[str, DeviceMesh] = field(default_factory=dict)
    role_groups: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None

    # ------------------------------------------------------------------------------ roles
    def group(self, role: str) -> dist.ProcessGroup | None:
        """The process group of this rank's group of ``role`` (``None`` on a single process).

        Raises:
            ValueError: an unknown role (the known ones listed).
        """
        self.layout.axes_of(role)
        return self.role_groups.get(role)

    def size(self, role: str) -> int:
        """The ranks of this rank's group of ``role``."""
        return self.layout.size(role)

    def rank(self, role: str) -> int:
        """This rank's place in its group of ``role``."""
        return self.layout.rank(role, self.world_rank)

    def members(self, role: str, of: int | None = None) -> list[int]:
        """The global ranks of the group of ``role`` that holds global rank ``of`` (default: this rank)."""
        return self.layout.group_of(role, self.world_rank if of is None else of)

    def device_mesh_of(self, role: str) -> DeviceMesh | None:
        """The device mesh of ``role``'s axes (flattened into one dimension when several join it)."""
        self.layout.axes_of(role)
        return self.role_meshes.get(role)

    def new_groups(self, rank_lists: Sequence[Sequence[int]]) -> Any | None:
        """Process groups over ``rank_lists`` (disjoint), made as the mesh's are; this rank's, or None.

        A collective: every rank calls it with the same lists (:func:`~lightning_parallel.distributed.
        tensors.new_subgroups`).
        """
        return new_subgroups(rank_lists, backend=self.backend)

    # --------------------------------------------------------------- the pipeline's own
    @property
    def pp_rank(self) -> int:
        return self.rank("pipeline")

    @property
    def pp_size(self) -> int:
        return self.size("pipeline")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """This replica's pipeline ranks (activations flow through it)."""
        return self.group("pipeline")

    @property
    def is_last_pipeline_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_rank(self) -> int:
        return self.rank("tensor")

    @property
    def tp_size(self) -> int:
        return self.size("tensor")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel ranks of this rank's stage replica (``None`` on a single process)."""
        return self.device_mesh_of("tensor")

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's pipeline."""
        return self.members("pipeline")[pp_rank]

    def data_parallel_mesh(self) -> DeviceMesh | None:
        """The mesh a stage is sharded on: the ``"shard"`` role's ranks, replicated over the rest of the
        ``"gradients"`` role's (HSDP: ``(dp_replicate, dp_shard)``; plain FSDP: ``dp_shard``)."""
        if self.device_mesh is None:
            return None
        sharded = [a.name for a in self.layout.axes_of("shard")]
        replicated = [a for a in self.layout.axes_of("gradients") if a.name not in sharded]
        shard = sharded[0] if len(sharded) == 1 else _flat_name(tuple(sharded))
        if any(a.size > 1 for a in replicated):
            return self.device_mesh[(*(a.name for a in replicated), shard)]
        return self.device_mesh[shard]


def build_mesh(device_type: str, layout: RankLayout, host_tensors: bool = False) -> PipelineMesh:
    """Create the device mesh and every role's group; every rank must call it (it is a collective).

    ``host_tensors``: host (CPU) tensors meet the job's collectives (FSDP2's offloaded shards: their
    gradients' norm, their full tensors in a checkpoint). Where the default group has no host backend (a
    process group started without one: by hand, or by an earlier fit in this process), the mesh's
    groups are made with one beside the device's (:func:`~lightning_parallel.distributed.host_group.
    group_backend`), so every group a role gives takes them: the one place that is decided.
    """
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise RuntimeError("build_mesh needs an initialised process group for more than one rank")
        return PipelineMesh(layout)
    backend = group_backend(device_type, host_tensors)
    names = tuple(axis.name for axis in layout.axes)
    override: dict[int | str, Any] | None = {name: backend for name in names} if backend else None
    # init_device_mesh numbers its grid row-major, which is RankLayout's pipeline-outermost order.
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=names, backend_override=override)
    meshes: dict[str, DeviceMesh] = {}
    flattened: dict[tuple[str, ...], DeviceMesh] = {}
    for role in ROLES:  # (the same order on every rank: flattening makes groups)
        axes = tuple(axis.name for axis in layout.axes_of(role))
        if len(axes) == 1:
            meshes[role] = mesh[axes[0]]
        elif axes:
            if axes not in flattened:
                # DeviceMesh._flatten is private (torch 2.13; torchtitan flattens its dp dimensions the same
                # way): the ranks of several dimensions as one.
                flattened[axes] = mesh[axes]._flatten(_flat_name(axes), backend_override=backend)
            meshes[role] = flattened[axes]
    groups = {role: role_mesh.get_group() for role, role_mesh in meshes.items()}
    return PipelineMesh(layout, dist.get_rank(), mesh, meshes, groups, backend)


def _flat_name(axes: tuple[str, ...]) -> str:
    return _FLAT_NAMES.get(axes, "_".join(axes))
