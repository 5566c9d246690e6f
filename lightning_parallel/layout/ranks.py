"""Where pipeline, data-parallel and tensor-parallel ranks sit among the global ranks, and which ranks
meet for what.

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

The grid is a list of **axes** (:class:`Axis`: a name, a size, the roles it joins), pipeline-outermost.
A **role** (:data:`ROLES`) is what a group of ranks does together: average a stage's gradients, read
different batches, count a step's tokens, ... The ranks of one group of a role differ on the axes that
join the role and agree on every other, so a new axis (sequence parallelism) is one entry in
:meth:`RankLayout.axes` that says which roles it joins, and the code that asks for a role's group,
size or rank is left as it is (torchtitan's ``parallel_dims.py`` builds its ``batch``, ``loss`` and
``fsdp`` meshes the same way).

The torch ``DeviceMesh`` built from a layout (:func:`lightning_parallel.layout.mesh.build_mesh`) has
the axes' names as its dimensions (:data:`MESH_DIMS` today).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

ROLES: dict[str, str] = {
    "pipeline": "the stages of one pipeline: activations, the last stage's logs, the clipping norm",
    "tensor": "the tensor-parallel ranks of one stage replica: the slices of its split weights",
    "gradients": "the ranks that hold one stage alike and average its gradients (one of them saves it)",
    "shard": "the ranks FSDP2 shards a stage's parameters over",
    "optimizer_shard": "the ranks ZeRO-1 shards a stage's optimizer state over",
    "data": "the ranks that read different batches: the sampler's replicas",
    "tokens": "the ranks whose items (tokens) make one optimizer step's mean",
    "metrics": "the ranks a torchmetrics Metric's sync gathers over",
    "logs": "the ranks a self.log(..., sync_dist=True) of the last stage reduces over",
    "step": "the ranks a collective in the user's step meets (self.all_gather, strategy.reduce)",
    "predictions": "the ranks whose predictions global rank 0 collects",
}
"""Every role a group of ranks plays, in the order the mesh builds their groups."""

DATA_PARALLEL_ROLES = frozenset(
    ("gradients", "optimizer_shard", "data", "tokens", "metrics", "logs", "step", "predictions")
)
"""What the data-parallel axes join (besides ``"shard"`` for ``dp_shard``): today every role but the
pipeline's, the tensor-parallel ranks' and FSDP2's sharding is played by the same ranks."""

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The axes' names, outermost first: the device mesh's dimensions."""


@dataclass(frozen=True)
class Axis:
    """One dimension of the rank grid: its name (the device mesh's dimension), size and the roles it joins.

    Example::

        Axis("sp", 2, frozenset({"gradients", "shard", "tokens", "metrics"}))   # not "data": one batch
    """

    name: str
    size: int
    roles: frozenset[str]


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
        layout.size("gradients"), layout.groups("pipeline")[1]                      # 4, [1, 5]
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
    def axes(self) -> tuple[Axis, ...]:
        """The grid's axes, outermost first, each with the roles it joins: the one list to extend."""
        return (
            Axis("pp", self.pp_size, frozenset({"pipeline"})),
            Axis("dp_replicate", self.dp_replicate_size, DATA_PARALLEL_ROLES),
            Axis("dp_shard", self.dp_shard_size, DATA_PARALLEL_ROLES | {"shard"}),
            Axis("tp", self.tp_size, frozenset({"tensor"})),
        )

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_size // self.dp_shard_size

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of the axes (:data:`MESH_DIMS`), in order."""
        return tuple(axis.size for axis in self.axes)

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

    # ------------------------------------------------------------------------------ roles
    def axes_of(self, role: str) -> tuple[Axis, ...]:
        """The axes that join ``role``, outermost first.

        Raises:
            ValueError: an unknown role (the known ones listed).
        """
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
        return tuple(axis for axis in self.axes if role in axis.roles)

    def size(self, role: str) -> int:
        """The ranks of one group of ``role``.

        Example::

            >>> RankLayout(pp_size=2, dp_size=4, dp_shard_size=2).size("shard")
            2
        """
        return math.prod(axis.size for axis in self.axes_of(role))

    def rank(self, role: str, global_rank: int) -> int:
        """``global_rank``'s place in its group of ``role`` (row-major over the role's axes).

        Example::

            >>> layout = RankLayout(pp_size=2, dp_size=2, tp_size=2)
            >>> layout.rank("data", 7), layout.rank("pipeline", 7), layout.rank("tensor", 7)
            (1, 1, 1)
        """
        joined = self.axes_of(role)
        place = dict(zip((a.name for a in self.axes), self._coordinate(global_rank)))
        return _row_major([place[a.name] for a in joined], [a.size for a in joined])

    def groups(self, role: str) -> list[list[int]]:
        """Every group of ``role``, as lists of global ranks (each in the role's row-major order); the
        groups in the row-major order of the other axes: the same list on every rank.

        Example::

            >>> RankLayout(pp_size=2, dp_size=2).groups("pipeline")
            [[0, 2], [1, 3]]
            >>> RankLayout(pp_size=2, dp_size=2).groups("gradients")
            [[0, 1], [2, 3]]
        """
        joined = [axis in self.axes_of(role) for axis in self.axes]
        # A rank's coordinate = its group's (the role's axes at 0) + its place in the group (the others at 0).
        outer = itertools.product(*(range(1) if j else range(a.size) for a, j in zip(self.axes, joined)))
        inner = list(itertools.product(*(range(a.size if j else 1) for a, j in zip(self.axes, joined))))
        return [[self._global(map(sum, zip(o, i))) for i in inner] for o in outer]

    def group_of(self, role: str, global_rank: int) -> list[int]:
        """The global ranks of ``global_rank``'s group of ``role``.

        Example::

            >>> RankLayout(pp_size=2, dp_size=2, tp_size=2).group_of("pipeline", 3)
            [3, 7]
        """
        return next(group for group in self.groups(role) if global_rank in group)

    def _coordinate(self, global_rank: int) -> tuple[int, ...]:
        """The rank's coordinate on every axis (row-major: the last axis innermost)."""
        coordinate = []
        for axis in reversed(self.axes):
            global_rank, place = divmod(global_rank, axis.size)
            coordinate.append(place)
        return tuple(reversed(coordinate))

    def _global(self, coordinate: Iterable[int]) -> int:
        return _row_major(list(coordinate), [a.size for a in self.axes])

    @classmethod
    def for_world(cls, world_size: int, pp_size: int, dp_shard_size: int = 1, tp_size: int = 1) -> RankLayout:
        """The layout of ``world_size`` ranks in pipelines of ``pp_size`` x ``tp_size``, or a clear error."""
        group = pp_size * tp_size
        if world_size % group:
            lower = world_size - world_size % group
            near = (lower, lower + group) if lower else (group, 2 * group)  # the two nearest multiples
            what = "pipeline_size" if tp_size == 1 else "pipeline_size x tensor_parallel_size"
            sizes = f"{pp_size}" if tp_size == 1 else f"{pp_size} x {tp_size} = {group}"
            raise ValueError(
                f"{what} ({sizes}) does not divide devices x nodes ({world_size}): use a multiple "
                f"of {group} devices (e.g. {near[0]} or {near[1]}), or change {what}"
            )
        return cls(pp_size, world_size // group, dp_shard_size, tp_size)


def _row_major(places: list[int], sizes: list[int]) -> int:
    index = 0
    for place, size in zip(places, sizes):
        index = index * size + place
    return index
