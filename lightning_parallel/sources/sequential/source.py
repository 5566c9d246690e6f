"""The Sequential path's builder: the module's top-level ``nn.Sequential`` split between its children."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.layout.choices import placement
from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.pipeline.blocks import block_type
from lightning_parallel.pipeline.partition import stage_costs
from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.stage_source import FirstInput, UnitNaming, UnsplitModel
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.sources.profile import layer_times
from lightning_parallel.sources.sequential.split import (
    check_parameters_inside,
    layer_facts,
    split_sequential,
    stage_descriptions,
    stage_parameters,
    stage_twins,
)
from lightning_parallel.sources.sequential.stages import SequentialStages
from lightning_parallel.sources.split_result import SplitResult
from lightning_parallel.sources.stage_plan import measured, stage_plan, units_per_stage
from lightning_parallel.sources.twin import alias_table


class SequentialSource:
    """A module whose layers sit in one top-level ``nn.Sequential``, found as ``(name, seq)``.

    Example::

        source = SequentialSource(find_sequential(model))
        split = source.build(plan, inputs, model, mesh, device, warn)   # this rank's stages
    """

    def __init__(self, found: tuple[str, nn.Sequential]) -> None:
        self.name, self.seq = found
        self.naming = UnitNaming(f"{self.name}.")

    def unsplit(self, module: nn.Module) -> UnsplitModel:
        """``module`` before the split: its units are the Sequential's layers (stage modules of them)."""
        return UnsplitModel(module, self.seq, self.name, graphs=False)

    def build(
        self,
        plan: ParallelPlan,
        inputs: FirstInput,
        module: nn.Module,
        mesh: PipelineMesh,
        device: torch.device,
        warn: Callable[[str], Any],
    ) -> SplitResult:
        """Plan the stages and keep this rank's layers (every rank calls it: errors are raised by all)."""
        name, seq = self.name, self.seq
        blocks = block_type(list(seq))  # (before the split: every stage compiles the same class)
        aliases = alias_table(module)
        num_stages = mesh.pp_size * plan.stages_per_rank
        with failing_together():
            check_parameters_inside(module, name)
            if num_stages > len(seq):
                raise ValueError(
                    f"pipeline_size x stages_per_rank ({mesh.pp_size} x {plan.stages_per_rank}) is larger "
                    f"than the number of layers in `{name}` ({len(seq)}): use fewer stages or split the "
                    f"model into more layers"
                )
        costs, unit = (
            self._layer_costs(plan, inputs) if plan.partition in ("parameters", "time") else (None, "")
        )
        with failing_together():
            counts = units_per_stage(
                plan.partition, costs, len(seq), num_stages, ("layers", "the Sequential")
            )
            units, holds = stage_descriptions(seq, counts)
            params = stage_parameters(module, name, units)
            cost_per_stage = costs and stage_costs(costs, counts)
            source = f"`{name}` (nn.Sequential)"
            style = placement(plan.schedule)
            stages_plan = stage_plan(
                module, units, holds, params, mesh.layout, cost_per_stage, unit, source, style
            )
            twins = stage_twins(seq, stages_plan)  # (before the split drops the other stages' layers)
            proxy, modules, indices = split_sequential(module, name, seq, stages_plan, mesh.pp_rank, device)
        stages = SequentialStages(
            modules,
            indices,
            stages_plan.num_stages,
            device,
            mesh.pp_group,
            twins,
            warn,
            self.naming,
            blocks,
            aliases,
        )
        runner = PipelineRunner(stages, stages_plan.num_stages, plan.schedule, plan.num_microbatches)
        # (the strategy gives the twins the precision it gives the model)
        return SplitResult(stages_plan, runner, proxy.call, nn.ModuleList(twins))

    def _layer_costs(self, plan: ParallelPlan, inputs: FirstInput) -> tuple[list[float], str]:
        seq = self.seq
        if plan.partition == "parameters":
            return [float(p) for p in layer_facts(seq)[2]], "parameters"

        def measure() -> list[float]:
            if any(p.is_meta for p in seq.parameters()):
                raise ValueError(
                    'partition="time" times the real layers, but the model is on the meta device: use '
                    'partition="parameters" or an explicit list with empty_init / configure_model'
                )
            args = inputs.capture(SequentialCapture(seq))
            return [1000.0 * t for t in layer_times(seq, args, next(seq.parameters()).device)]

        return measured(measure), "ms fwd+bwd"


class SequentialCapture:
    """Stop the user's step at its call of the Sequential (a forward pre-hook) to read that call's input."""

    def __init__(self, seq: nn.Sequential) -> None:
        self.seq = seq

    def capture(self, step: Any, *args: Any) -> tuple[Any, ...]:
        call = PipelinedCall("the pipelined Sequential")

        def stop(_mod: nn.Module, inputs: tuple[Any, ...]) -> None:
            call(*inputs)  # in capture mode: raises CapturedInput(inputs)

        handle = self.seq.register_forward_pre_hook(stop)
        try:
            return call.capture(step, *args)
        finally:
            handle.remove()
