"""PipelineStrategy's memory options: recompute the stages' units, shard optimizer state over replicas.

Glue only: the mechanics are :mod:`lightning_parallel.parallelize.recompute` and
:mod:`lightning_parallel.grads.zero`. A unit is named by its path in the LightningModule: a layer
of the split Sequential (``"layers.3"``) or a module the traced stages call (``"h.2"``, ``"lm_head"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.grads.zero import shard_optimizer_state
from lightning_parallel.parallelize.recompute import apply_activation_checkpointing
from lightning_parallel.plan.checks import Selection
from lightning_parallel.strategies.pipeline.source_glue import UnitNaming, prefixed

if TYPE_CHECKING:
    import torch

    from lightning_parallel.pipeline.mesh import PipelineMesh
    from lightning_parallel.strategies.pipeline.build import PipelineParts


def install_checkpointing(parts: PipelineParts, select: Selection) -> None:
    """Recompute the selected units of this rank's stages; names are checked against every stage's units.

    The plan is the same on every rank, so an unknown name raises the same error on every rank.
    """
    if select is False:
        return
    naming = parts.glue.naming
    every = [naming.prefix + u for stage in parts.plan.stages for u in stage.units]
    if not callable(select) and not isinstance(select, bool):
        unknown = [n for n in select if n not in every]
        if unknown:
            raise ValueError(
                f"activation_checkpointing names units that do not exist: {unknown}; the units are {every}"
            )

    def wrap(units: Sequence[tuple[str, nn.Module]]) -> None:
        named = prefixed(naming, units)
        apply_activation_checkpointing(named, _local(select, named, naming))

    # now (the Sequential's stage modules) or as each stage is prepared (the traced programs')
    parts.runner.stages.recompute(wrap)


def _local(select: Selection, units: Sequence[tuple[str, Any]], naming: UnitNaming) -> Selection:
    if select is True and naming.blocks:
        return [n for n, _ in units if n.startswith(naming.blocks)]
    if isinstance(select, bool) or callable(select):
        return select
    here = {n for n, _ in units}
    return [n for n in select if n in here]


def shard_optimizers(
    optimizers: list[torch.optim.Optimizer], scheduler_configs: list[Any], mesh: PipelineMesh | None
) -> list[torch.optim.Optimizer]:
    """Each optimizer as a ZeroRedundancyOptimizer over this stage's replicas (right after creation).

    The LR schedulers of ``scheduler_configs`` (Lightning's ``LRSchedulerConfig``) follow the new optimizers.
    """
    if mesh is None or mesh.dp_size == 1:
        rank_zero_info("PipelineStrategy(shard_optimizer_state=True): one replica per stage, none to shard")
        return optimizers
    schedulers = [config.scheduler for config in scheduler_configs]
    sharded = [shard_optimizer_state(o, mesh.dp_group, schedulers) for o in optimizers]
    rank_zero_info(
        f"PipelineStrategy: optimizer state sharded over the {mesh.dp_size} replicas of each stage "
        f"(ZeroRedundancyOptimizer)"
    )
    return sharded
