"""PipelineStrategy's memory options: recompute the stages' layers, shard optimizer state over replicas.

Glue only: the mechanics are :mod:`lightning_parallel.pipeline.recompute` and
:mod:`lightning_parallel.pipeline.zero`. Layers are named by their path in the LightningModule
(``"layers.3"``: the Sequential's attribute, then the child name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.pipeline.recompute import Selection, apply_activation_checkpointing, select_units
from lightning_parallel.pipeline.zero import shard_optimizer_state

if TYPE_CHECKING:
    from lightning_parallel.strategies.pipeline import PipelineStrategy


def checkpointed_layers(seq_name: str, seq: nn.Sequential, select: Selection) -> list[str]:
    """The layers to recompute, checked against the whole Sequential (before the split, on every rank).

    Each rank keeps only its own stage, so a name is validated here, where all layers are known;
    every rank raises the same error before any collective.
    """
    return select_units([(f"{seq_name}.{n}", m) for n, m in seq.named_children()], select)


def checkpoint_stages(stage_modules: Sequence[nn.Module], seq_name: str, chosen: Sequence[str]) -> None:
    """Wrap this rank's chosen layers (each stage module's children) in activation checkpointing."""
    for stage in stage_modules:
        units = [(f"{seq_name}.{n}", m) for n, m in stage.named_children()]
        local = {name for name, _ in units}
        apply_activation_checkpointing(units, [n for n in chosen if n in local])


def shard_optimizers(strategy: PipelineStrategy) -> None:
    """Replace each optimizer by a ZeroRedundancyOptimizer over this stage's replicas (after creation)."""
    mesh = strategy.mesh
    if mesh is None or mesh.dp_size == 1:
        rank_zero_info("PipelineStrategy(shard_optimizer_state=True): one replica per stage, none to shard")
        return
    schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]
    strategy.optimizers = [shard_optimizer_state(o, mesh.dp_group, schedulers) for o in strategy.optimizers]
    rank_zero_info(
        f"PipelineStrategy: optimizer state sharded over the {mesh.dp_size} replicas of each stage "
        f"(ZeroRedundancyOptimizer)"
    )
