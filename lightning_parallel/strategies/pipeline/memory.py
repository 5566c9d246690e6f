"""PipelineStrategy's memory options: recompute the stages' units, shard optimizer state over replicas.

Glue only: the mechanics are :mod:`lightning_parallel.parallelize.recompute` and
:mod:`lightning_parallel.grads.zero`. A unit is named by its path in the LightningModule: a layer
of the split Sequential (``"layers.3"``) or a module the traced stages call (``"h.2"``, ``"lm_head"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.grads.zero import shard_optimizer_state
from lightning_parallel.parallelize.recompute import Selection, apply_activation_checkpointing
from lightning_parallel.pipeline.blocks import find_block_list
from lightning_parallel.pipeline.split import SequentialStages, find_sequential

if TYPE_CHECKING:
    import torch

    from lightning_parallel.pipeline.mesh import PipelineMesh
    from lightning_parallel.strategies.pipeline.build import PipelineParts
    from lightning_parallel.strategies.pipeline.config import PipelineConfig


@dataclass(frozen=True)
class UnitNaming:
    """How a stage's units are named: ``prefix`` + the plan's unit (``"layers."`` on the Sequential path).

    ``blocks``: on the traced path, the block list's path (``"h."``): ``True`` recomputes its blocks only,
    not the embeddings or the head the first and last stages also call (nothing to gain there).
    """

    prefix: str = ""
    blocks: str | None = None


def unit_naming(module: nn.Module, config: PipelineConfig) -> UnitNaming:
    """Read on the unsplit module, before the split (errors are left to the split, which raises them)."""
    try:
        found = find_sequential(module, config.module_name) if config.split_points is None else None
        if found is not None:
            return UnitNaming(f"{found[0]}.")
        path, _ = find_block_list(module)
        return UnitNaming("", f"{path}.")
    except ValueError:
        return UnitNaming()


def install_checkpointing(parts: PipelineParts, select: Selection, naming: UnitNaming) -> None:
    """Recompute the selected units of this rank's stages; names are checked against every stage's units.

    The plan is the same on every rank, so an unknown name raises the same error on every rank.
    """
    if select is False:
        return
    every = [naming.prefix + u for stage in parts.plan.stages for u in stage.units]
    if not callable(select) and not isinstance(select, bool):
        unknown = [n for n in select if n not in every]
        if unknown:
            raise ValueError(
                f"activation_checkpointing names units that do not exist: {unknown}; the units are {every}"
            )
    stages = parts.runner.stages

    def wrap(units: Sequence[tuple[str, nn.Module]]) -> None:
        apply_activation_checkpointing(units, _local(select, units, naming))

    if isinstance(stages, SequentialStages):
        wrap([(naming.prefix + name, layer) for name, layer in stages.units()])
    else:
        stages.wrap_units = wrap  # the traced path builds its stage modules per input shape


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
