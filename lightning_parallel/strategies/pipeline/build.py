"""Build this rank's pipeline for PipelineStrategy: the source, the split, the shared weights, the steps'
bookkeeping.

Two stage sources (:mod:`lightning_parallel.sources`), decided once by :func:`source_for`:

* the **Sequential path**, when the module holds its layers in one top-level ``nn.Sequential``: the
  Sequential's children are partitioned into stages;
* the **traced path** otherwise, or with ``split_points``: ``forward`` is exported on a meta twin of
  the module and split at its blocks.

Every collective here is reached by every rank: the local work that may fail on one rank runs under
``failing_together``, so all ranks raise its error together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.grads.item_weights import ItemCount
from lightning_parallel.grads.tied import SharedReplicas, find_shared
from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.pipeline.metrics import StageMetrics
from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.stage_source import FirstInput
from lightning_parallel.pipeline.step_scope import StepScope
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.sources.sequential.source import SequentialSource
from lightning_parallel.sources.sequential.split import find_sequential
from lightning_parallel.sources.traced.source import TracedSource
from lightning_parallel.sources.twin import alias_table
from lightning_parallel.strategies.pipeline.items import StepItems, step_items
from lightning_parallel.techniques import item_count


def source_for(module: nn.Module, plan: ParallelPlan) -> SequentialSource | TracedSource:
    """Which stage source splits ``module``: the one decision (every rank decides alike).

    Example::

        source = source_for(model, strategy.parallel_plan)
        source.unsplit(model), source.build(plan, inputs, model, mesh, device, warn)
    """
    with failing_together():
        found = find_sequential(module, plan.module_name) if plan.split_points is None else None
    return SequentialSource(found) if found is not None else TracedSource()


@dataclass(frozen=True)
class PipelineParts:
    """This rank's pipeline as the build made it: what the strategy's steps, backward and state code read.

    Immutable: :func:`build_pipeline` makes it after the split, :meth:`parallelized` the value after the
    techniques' transforms of the stages (the FSDP roots, the parameters they put in place); what the
    steps carry from one to the next lives apart (``step_state.py: StepState``).

    Example::

        parts = build_pipeline(source, plan, inputs, module, mesh, device, warn)
        parts = parts.parallelized(runner.stages.sharded(), replaced)     # after the techniques
    """

    mesh: PipelineMesh
    plan: StagePlan
    runner: PipelineRunner
    call: PipelinedCall  # the stand-in the user's step calls (``self.layers(x)`` or ``self(x)``)
    shared: SharedReplicas
    param_names: Mapping[nn.Parameter, str]  # this rank's parameters -> canonical names (FSDP2 swaps them)
    model_keys: list[str]  # the unsplit module's state-dict keys
    model_param_order: list[str]  # the unsplit module's parameter names, in parameters() order
    twin: nn.Module  # the meta twin stages are sized (and traced) on; precision applies to it too
    items: StepItems | None  # how training steps count their items (token-exact losses), if they do
    scope: StepScope  # marks the user's step code while it runs
    metrics: StageMetrics  # the module's torchmetrics Metrics, adapted to the stages
    sharded: list[nn.Module] = field(default_factory=list)  # the FSDP roots, once parallelized

    def parallelized(self, roots: list[nn.Module], replaced: Mapping[int, nn.Parameter]) -> PipelineParts:
        """This pipeline after the techniques: their FSDP roots, and the parameters they put in place of
        the old ones (``id(old) -> new``) wherever the build named them."""
        if not replaced:
            return replace(self, sharded=list(roots))
        names = {replaced.get(id(p), p): n for p, n in self.param_names.items()}
        return replace(self, sharded=list(roots), param_names=names, shared=self.shared.rebound(replaced))


def build_pipeline(
    source: SequentialSource | TracedSource,
    plan: ParallelPlan,
    inputs: FirstInput,
    module: nn.Module,
    mesh: PipelineMesh,
    device: torch.device,
    warn: Callable[[str], Any],
    count: ItemCount | None = None,
) -> PipelineParts:
    """Split ``module`` on this rank with ``source``; every rank calls it (it creates process groups).

    ``count``: how the steps count items (a ``TokenWeightedLoss``'s), or None.
    """
    model_keys = list(module.state_dict().keys())
    model_param_order = [n for n, _ in module.named_parameters()]
    aliases = alias_table(module)
    split = source.build(plan, inputs, module, mesh, device, warn)
    stages = split.plan
    local = {aliases[n]: p for n, p in module.named_parameters(remove_duplicate=False)}
    shared = SharedReplicas(
        find_shared([s.parameters for s in stages.stages], mesh.pp_size, stages.style), mesh, local
    )
    shared.broadcast_from_owners()
    param_names = {p: aliases[n] for n, p in module.named_parameters()}
    pipelined = mesh.pp_size > 1
    scope = StepScope(frozenset(mesh.layout.replicas_of(mesh.pp_rank)) if pipelined else None)
    last = mesh.global_rank(stages.pp_rank_of(stages.num_stages - 1))
    metrics = StageMetrics(scope, mesh.group("metrics"), mesh.pp_group if pipelined else None, last)
    metrics.adapt_module(module)
    return PipelineParts(
        mesh, stages, split.runner, split.call, shared, param_names, model_keys, model_param_order,
        split.twin, step_items(module, split.call, item_count(plan, mesh, count) if count else None), scope,
        metrics,
    )  # fmt: skip
