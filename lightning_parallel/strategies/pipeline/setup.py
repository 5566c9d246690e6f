"""PipelineStrategy's set-up, in its order: split, recompute, parallelize, then the optimizers.

Split first (every rank holds the same module; the split is collective), then recompute the stages'
units (and keep the activations on the host, if offloaded), the precision plugin converts the stages,
then the techniques in torchtitan's order (tensor parallelism, ``parallelize_fn``, compile, data-parallel
sharding), then the optimizers built by the user's ``configure_optimizers`` are wrapped (ZeRO-1, offload
to the host) and the precision plugin's clipping and loss scaling made global. Each step here is a
function of the strategy (``strategy.parallel_plan`` says what to do).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.grads.sync import GradientSync
from lightning_parallel.strategies.pipeline import autoplan
from lightning_parallel.strategies.pipeline.build import PipelineParts, build_pipeline, source_for
from lightning_parallel.strategies.pipeline.call_input import TrainerInput
from lightning_parallel.strategies.pipeline.precision import install_global_clipping, install_loss_scaling
from lightning_parallel.strategies.pipeline.refusals import refuse_compiled_module, refuse_offload
from lightning_parallel.strategies.pipeline.summary import summarize_before_split
from lightning_parallel.techniques import recompute, zero
from lightning_parallel.techniques.compile import CompileWatch
from lightning_parallel.techniques.offload import apply as offload
from lightning_parallel.techniques.parallelize import parallelize as apply_techniques


def split(strategy: Any, trainer: pl.Trainer, fitting: bool) -> tuple[PipelineParts, Any]:
    """This rank's pipeline, its units recomputed as planned; and the tensor-parallel plan (or None).

    Every rank calls it (it is collective); an error on one rank is raised on every rank.
    """
    if strategy._auto is not None:  # plan="auto": the plan chosen on rank 0, applied on every rank; the mesh
        autoplan.decide(strategy, trainer)
    module, plan = strategy.lightning_module, strategy.parallel_plan
    refuse_compiled_module(module)  # (every rank holds the same module)
    refuse_offload(plan, strategy.root_device)
    if fitting:
        summarize_before_split(trainer, module, strategy)  # the whole model's table
    source = source_for(module, plan)
    with failing_together():
        tensors = source.tensor_plan(module, plan)  # (read on the unsplit module)
    inputs, mesh = TrainerInput(trainer, module), strategy._mesh
    parts = build_pipeline(
        source, plan, inputs, module, mesh, strategy.root_device, rank_zero_warn, strategy._item_count
    )
    every_unit = [parts.runner.stages.naming.prefix + u for stage in parts.plan.stages for u in stage.units]
    recompute.apply(parts.runner.stages, plan.activation_checkpointing, every_unit)
    if "activations" in plan.offload:
        offload.apply_activations(parts.runner, offload.pins(plan.offload_pin_memory, strategy.root_device))
    rank_zero_info(f"PipelineStrategy stage plan ({plan.schedule}):\n{parts.plan.format_table()}")
    return parts, tensors


def parallelize(
    strategy: Any, parts: PipelineParts, tensors: Any
) -> tuple[GradientSync, CompileWatch | None]:
    """After the split: the techniques on this rank's stages; the optimizer step's gradient sync, and
    the watch on torch.compile (when the stages are compiled)."""
    plan, module = strategy.parallel_plan, strategy.lightning_module
    before = dict(module.named_parameters())
    done = apply_techniques(parts.runner.stages, plan, parts.mesh, module, tensors)
    after = dict(module.named_parameters())
    parts.parallelized(done.roots, {id(p): after[n] for n, p in before.items() if after.get(n, p) is not p})
    for note in done.notes:
        rank_zero_info(f"PipelineStrategy: {note}")
    watch = None
    if plan.compile is not None:
        watch = CompileWatch(rank_zero_warn, rank_zero_info)
        watch.start()
    window = parts.items.window if parts.items is not None else None
    mesh = parts.mesh
    return GradientSync(module, parts.sharded, parts.shared, mesh.dp_group, mesh.dp_size, window), watch


def prepare_optimizers(strategy: Any, trainer: pl.Trainer, parts: PipelineParts) -> None:
    """The user's optimizers, sharded as planned (ZeRO-1), their state and step on the host or the
    device; clipping and loss scaling made global (one norm over the pipeline, one skip decision under
    fp16)."""
    strategy.setup_optimizers(trainer)
    plan, group = strategy.parallel_plan, parts.mesh.dp_group
    schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]
    on_host = "optimizer" in plan.offload
    if plan.offload:
        pin = offload.pins(plan.offload_pin_memory, strategy.root_device)
        rank_zero_info(f"PipelineStrategy: {offload.describe(plan.offload, pin)}")
    if on_host:  # (its step on the host, ZeRO-1's shard too; an error is every rank's, before training)
        with failing_together():
            strategy.optimizers = offload.apply(strategy.optimizers, schedulers, plan, group, pin)
    elif plan.shard_optimizer_state:  # ZeRO-1 over the replicas of each stage
        strategy.optimizers = zero.apply(strategy.optimizers, schedulers, group)
    if plan.shard_optimizer_state:
        rank_zero_info(f"PipelineStrategy: optimizer state sharded over {parts.mesh.dp_size} replica(s)")
    if not on_host:
        _optimizers_to_device(strategy.optimizers, strategy.root_device)
    install_global_clipping(strategy.precision_plugin, parts.mesh.pp_group, parts.shared)
    install_loss_scaling(strategy.precision_plugin, strategy.optimizers)  # 16-mixed: one skip decision
