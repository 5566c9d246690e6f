"""Build this rank's pipeline for PipelineStrategy: the plan, the split, the runner, the shared weights.

Two ways to split, one result (:class:`PipelineParts`):

* the **Sequential path** (:mod:`.sequential`), when the module holds its layers in one
  top-level ``nn.Sequential``: the Sequential's children are partitioned into stages;
* the **traced path** (:mod:`.traced`) otherwise, or with ``split_points``: ``forward`` is
  split with torch's tracing frontend on a meta twin of the module.

Every collective here is reached by every rank: the local work that may fail on one rank runs under
``failing_together``, so all ranks raise its error together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.distributed.record_broadcast import RecordBroadcast
from lightning_parallel.grads.held import HeldGradients
from lightning_parallel.grads.tied import SharedReplicas, find_shared
from lightning_parallel.pipeline.mesh import PipelineMesh, build_mesh
from lightning_parallel.pipeline.metrics import StageMetrics
from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.split import find_sequential
from lightning_parallel.pipeline.step_scope import StepScope
from lightning_parallel.pipeline.twin import alias_table
from lightning_parallel.plan.layout import RankLayout
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.strategies.pipeline.items import StepItems
from lightning_parallel.strategies.pipeline.refusals import refuse_traced_parallelize
from lightning_parallel.strategies.pipeline.sequential import sequential_path
from lightning_parallel.strategies.pipeline.source_glue import SourceGlue
from lightning_parallel.strategies.pipeline.traced import traced_path
from lightning_parallel.timeline.recorder import Timeline


@dataclass
class PipelineParts:
    """This rank's pipeline: what the strategy's steps, backward and state code work with."""

    mesh: PipelineMesh
    plan: StagePlan
    runner: PipelineRunner
    call: PipelinedCall  # the stand-in the user's step calls (``self.layers(x)`` or ``self(x)``)
    glue: SourceGlue  # what the strategy does differently for this rank's stage source
    shared: SharedReplicas
    param_names: dict[nn.Parameter, str]  # this rank's parameters -> canonical names
    model_keys: list[str]  # the unsplit module's state-dict keys
    model_param_order: list[str]  # the unsplit module's parameter names, in parameters() order
    twin: nn.Module | None = (
        None  # the meta twin stages are sized (and traced) on; precision applies to it too
    )
    held: HeldGradients = field(default_factory=HeldGradients)
    predict_batches: list[int] | None = None
    sharded: list[nn.Module] = field(default_factory=list)  # stage modules that are FSDP roots
    channels: dict[str, RecordBroadcast] = field(
        default_factory=dict
    )  # last stage -> others, per step method
    timeline: Timeline | None = None  # set by the PipelineTimeline callback for the steps it records
    items: StepItems | None = None  # how training steps count their items (token-exact losses), if they do
    scope: StepScope = field(default_factory=StepScope)  # marks the user's step code while it runs
    metrics: StageMetrics | None = None  # the module's torchmetrics Metrics, adapted to the stages


def build_pipeline(
    config: ParallelPlan,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    layout: RankLayout,
    device: torch.device,
    mesh: PipelineMesh | None = None,
) -> PipelineParts:
    """Plan and split ``module`` on this rank; every rank calls it (it creates process groups)."""
    mesh = build_mesh(device.type, layout) if mesh is None else mesh
    model_keys = list(module.state_dict().keys())
    model_param_order = [n for n, _ in module.named_parameters()]
    aliases = alias_table(module)
    with failing_together():
        found = find_sequential(module, config.module_name) if config.split_points is None else None
    if found is not None:
        plan, runner, call, twin, glue = sequential_path(config, trainer, module, found, mesh, device)
    else:
        with failing_together():
            refuse_traced_parallelize(config)
        plan, runner, call, twin, glue = traced_path(config, trainer, module, mesh, aliases, device)
    local = {aliases[n]: p for n, p in module.named_parameters(remove_duplicate=False)}
    shared = SharedReplicas(
        find_shared([s.parameters for s in plan.stages], layout.pp_size, plan.style), mesh, local
    )
    shared.broadcast_from_owners()
    param_names = {p: aliases[n] for n, p in module.named_parameters()}
    parts = PipelineParts(
        mesh, plan, runner, call, glue, shared, param_names, model_keys, model_param_order, twin
    )
    _adapt_to_steps(parts, module)
    return parts


def _adapt_to_steps(parts: PipelineParts, module: nn.Module) -> None:
    """The step scope (who runs the step's code) and the module's Metrics, adapted to where it runs."""
    mesh, plan = parts.mesh, parts.plan
    pipelined = mesh.pp_size > 1
    parts.scope = StepScope(frozenset(mesh.layout.replicas_of(mesh.pp_rank)) if pipelined else None)
    last = mesh.global_rank(plan.pp_rank_of(plan.num_stages - 1))
    parts.metrics = StageMetrics(parts.scope, mesh.dp_group, mesh.pp_group if pipelined else None, last)
    parts.metrics.adapt_module(module)
