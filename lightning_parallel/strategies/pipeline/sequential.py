"""The Sequential path: the module's top-level ``nn.Sequential`` is partitioned between its children."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.pipeline.mesh import PipelineMesh
from lightning_parallel.pipeline.partition import stage_costs
from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.pipeline.profile import layer_times
from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.split import (
    SequentialStages,
    check_parameters_inside,
    layer_facts,
    split_sequential,
    stage_descriptions,
    stage_parameters,
    stage_twins,
)
from lightning_parallel.plan.choices import placement
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.strategies.pipeline.call_input import SequentialCapture, captured_input
from lightning_parallel.strategies.pipeline.plan import measured, stage_plan, units_per_stage
from lightning_parallel.strategies.pipeline.source_glue import SequentialGlue
from lightning_parallel.techniques.compile import block_type
from lightning_parallel.techniques.recompute import UnitNaming


def sequential_path(
    config: ParallelPlan,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    found: tuple[str, nn.Sequential],
    mesh: PipelineMesh,
    device: torch.device,
) -> tuple[StagePlan, PipelineRunner, PipelinedCall, nn.Module, SequentialGlue]:
    seq_name, seq = found
    blocks = block_type(list(seq)) if config.compile is not None else None  # (before the split)
    num_stages = mesh.pp_size * config.stages_per_rank
    with failing_together():
        check_parameters_inside(module, seq_name)
        if num_stages > len(seq):
            raise ValueError(
                f"pipeline_size x stages_per_rank ({mesh.pp_size} x {config.stages_per_rank}) is larger than "
                f"the number of layers in `{seq_name}` ({len(seq)}): use fewer stages or split the model "
                f"into more layers"
            )
    costs, unit = None, ""
    if config.partition in ("parameters", "time"):
        costs, unit = _layer_costs(config, trainer, module, seq)
    with failing_together():
        counts = units_per_stage(config.partition, costs, len(seq), num_stages, ("layers", "the Sequential"))
        units, holds = stage_descriptions(seq, counts)
        params = stage_parameters(module, seq_name, units)
        cost_per_stage = costs and stage_costs(costs, counts)
        source = f"`{seq_name}` (nn.Sequential)"
        style = placement(config.schedule)
        plan = stage_plan(module, units, holds, params, mesh.layout, cost_per_stage, unit, source, style)
        twins = stage_twins(seq, plan)  # (before the split drops the other stages' layers)
        proxy, stage_modules, indices = split_sequential(module, seq_name, seq, plan, mesh.pp_rank, device)
    stages = SequentialStages(
        stage_modules, indices, plan.num_stages, device, mesh.pp_group, twins, warn=rank_zero_warn
    )
    return (
        plan,
        PipelineRunner(stages, plan.num_stages, config.schedule, config.num_microbatches),
        proxy.call,
        nn.ModuleList(twins),  # (the strategy gives the twins the precision it gives the model)
        SequentialGlue(stages, seq_name, blocks, UnitNaming(f"{seq_name}.")),
    )


def _layer_costs(
    config: ParallelPlan, trainer: pl.Trainer, module: pl.LightningModule, seq: nn.Sequential
) -> tuple[list[float], str]:
    if config.partition == "parameters":
        return [float(p) for p in layer_facts(seq)[2]], "parameters"

    def measure() -> list[float]:
        if any(p.is_meta for p in seq.parameters()):
            raise ValueError(
                'partition="time" times the real layers, but the model is on the meta device: use '
                'partition="parameters" or an explicit list with empty_init / configure_model'
            )
        args = captured_input(trainer, module, SequentialCapture(seq))
        return [1000.0 * t for t in layer_times(seq, args, next(seq.parameters()).device)]

    return measured(measure), "ms fwd+bwd"
