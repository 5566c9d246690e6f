"""Where pipeline, data-parallel and tensor-parallel ranks sit among the global ranks.

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

The torch ``DeviceMesh`` built from a layout (:func:`lightning_parallel.layout.mesh.build_mesh`) has
the named dimensions of :data:`MESH_DIMS`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
            near = (lower, lower + group) if lower else (group, 2 * group)  # the two nearest multiples
            what = "pipeline_size" if tp_size == 1 else "pipeline_size x tensor_parallel_size"
            sizes = f"{pp_size}" if tp_size == 1 else f"{pp_size} x {tp_size} = {group}"
            raise ValueError(
                f"{what} ({sizes}) does not divide devices x nodes ({world_size}): use a multiple "
                f"of {group} devices (e.g. {near[0]} or {near[1]}), or change {what}"
            )
        return cls(pp_size, world_size // group, dp_shard_size, tp_size)
