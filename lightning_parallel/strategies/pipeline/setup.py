"""PipelineStrategy's set-up, in its order: split, then the techniques on the stages, then the optimizers.

Split first (every rank holds the same module; the split is collective), the precision plugin converts
the stages, then each technique transforms this rank's stages in the list's order
(:data:`~lightning_parallel.techniques.TECHNIQUES`: recomputation, tensor parallelism,
``parallelize_fn``, compile, data-parallel sharding, ...), gives the runner its context around each
training step and the optimizer step its gradient reductions; then the optimizers built by the user's
``configure_optimizers`` go through the techniques in the same order (ZeRO-1, offload to the host), and
the precision plugin's clipping and loss scaling are made global. Nothing here names a technique: each
step folds the list (``strategy.parallel_plan`` says what each does).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.grads.sync import GradientSync
from lightning_parallel.strategies.pipeline.build import PipelineParts, build_pipeline, source_for
from lightning_parallel.strategies.pipeline.call_input import TrainerInput
from lightning_parallel.strategies.pipeline.precision import install_global_clipping, install_loss_scaling
from lightning_parallel.strategies.pipeline.refusals import refuse_compiled_module
from lightning_parallel.strategies.pipeline.summary import summarize_before_split
from lightning_parallel.techniques import (
    TECHNIQUES,
    batch_transform,
    before_split,
    environment,
    transform_stages,
)
from lightning_parallel.techniques.compile import CompileWatch
from lightning_parallel.techniques.job import Environment, Job, StepPhase


def environment_of(strategy: Any) -> Environment:
    """What the strategy's plan needs of the job on its device (a host backend, parameters on the host)."""
    return environment(strategy.parallel_plan, strategy.root_device)


def split(strategy: Any, trainer: pl.Trainer, fitting: bool) -> tuple[PipelineParts, dict[str, Any]]:
    """This rank's pipeline; and what the techniques read on the unsplit module (by technique).

    Every rank calls it (it is collective); an error on one rank is raised on every rank.
    """
    module, plan = strategy.lightning_module, strategy.parallel_plan
    refuse_compiled_module(module)  # (every rank holds the same module)
    if fitting:
        summarize_before_split(trainer, module, strategy)  # the whole model's table
    strategy._batch_transform = batch_transform(plan, strategy._mesh, module)  # (every batch, the first)
    parts, read = split_module(
        trainer,
        module,
        plan,
        strategy._mesh,
        strategy.root_device,
        strategy._item_count,
        rank_zero_warn,
        strategy._batch_transform,
    )
    rank_zero_info(f"PipelineStrategy stage plan ({plan.schedule}):\n{parts.plan.format_table()}")
    return parts, read


def split_module(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    plan: Any,
    mesh: Any,
    device: Any,
    count: Any = None,
    warn: Any = rank_zero_warn,
    transform: Any = None,
) -> tuple[PipelineParts, dict[str, Any]]:
    """Split ``module`` with ``plan`` on ``mesh`` (every rank calls it): this rank's pipeline, and what the
    techniques read on the unsplit module (by technique). What :func:`split` and ``plan="auto"``'s trials
    (each candidate on a copy of the module) share; ``transform``: the techniques' batch transform (a
    sequence's shard), applied to the batch the split traces."""
    source = source_for(module, plan)
    with failing_together():
        read = before_split(plan, source.unsplit(module))  # (the techniques' reading and refusals)
    inputs = TrainerInput(trainer, module, transform)
    return build_pipeline(source, plan, inputs, module, mesh, device, warn, count), read


def parallelize(
    strategy: Any, parts: PipelineParts, read: dict[str, Any]
) -> tuple[PipelineParts, Job, GradientSync, CompileWatch | None]:
    """After the split: the techniques on this rank's stages, in the list's order; the pipeline after them,
    the job they saw, the optimizer step's gradient sync, and the watch on torch.compile (when the stages
    are compiled)."""
    parts, job, sync = apply_techniques(strategy.parallel_plan, strategy.lightning_module,
                                        strategy.root_device, parts, read,
                                        phase=strategy.step_state.phase)  # fmt: skip
    watch = None
    if job.plan.compiled:  # (its time is the strategy's compile_seconds, around every kind of step)
        watch = CompileWatch(rank_zero_warn, rank_zero_info)
        watch.start()
    return parts, job, sync, watch


def apply_techniques(
    plan: Any, module: pl.LightningModule, device: Any, parts: PipelineParts, read: dict[str, Any],
    log: bool = True, phase: StepPhase | None = None,
) -> tuple[PipelineParts, Job, GradientSync]:  # fmt: skip
    """The techniques on this rank's stages of ``module``, in the list's order; the pipeline after them,
    the job they saw and the optimizer step's gradient sync (``log``: rank 0 prints their notes; a
    trial's are not printed; ``phase``: the strategy's, which its training steps set: a trial's, never
    set, reduces its gradients at the sync, not overlapped)."""
    mesh, stages = parts.mesh, parts.runner.stages
    info, warn = (rank_zero_info, rank_zero_warn) if log else (_quiet, _quiet)
    tied = tuple(p.name for p in parts.shared.shared)
    job = Job(plan, mesh, device, stages, module, parts.plan, read, warn=warn, info=info,
              phase=phase if phase is not None else StepPhase(), tied=tied)  # fmt: skip
    before = dict(module.named_parameters())
    notes = transform_stages(job)
    after = dict(module.named_parameters())
    replaced = {id(p): after[n] for n, p in before.items() if after.get(n, p) is not p}
    parts = parts.parallelized([m for m in stages.modules if isinstance(m, FSDPModule)], replaced)
    for note in notes:
        info(f"PipelineStrategy: {note}")
    parts.runner.use_step_contexts([c for t in TECHNIQUES if (c := t.step_context(job)) is not None])
    window = parts.items.window if parts.items is not None else None
    reductions = [r for t in TECHNIQUES for r in t.reductions(job)]
    return parts, job, GradientSync(module, parts.shared, reductions, mesh.size("gradients"), window)


def transformed_optimizers(optimizers: list[Any], job: Job) -> list[Any]:
    """``optimizers`` through each technique in the list's order (sharded, their state and step on the
    host, ...); an error is every rank's, before training."""
    with failing_together():
        for technique in TECHNIQUES:
            optimizers = technique.optimizers(optimizers, job)
    return optimizers


def _quiet(message: str) -> None:
    """A trial's logging: nothing (the trials' own table says what ran)."""


def prepare_optimizers(strategy: Any, trainer: pl.Trainer, parts: PipelineParts, job: Job) -> None:
    """The user's optimizers, through each technique in the list's order (sharded, their state and step
    on the host, ...); clipping and loss scaling made global (one norm over the pipeline, one skip
    decision under fp16)."""
    strategy.setup_optimizers(trainer)
    _optimizers_to_device(strategy.optimizers, strategy.root_device)  # (fresh: their state is empty)
    job = replace(job, schedulers=tuple(config.scheduler for config in strategy.lr_scheduler_configs))
    strategy.optimizers = transformed_optimizers(list(strategy.optimizers), job)
    install_global_clipping(strategy.precision_plugin, parts.mesh.pp_group, parts.shared)
    install_loss_scaling(strategy.precision_plugin, strategy.optimizers)  # 16-mixed: one skip decision


def release_optimizers(strategy: Any, job: Job | None) -> None:
    """What the techniques' optimizers hold beyond the run (the disk tier's files), released at the
    strategy's teardown: the end of a fit, a stop, an error (Lightning marks the last two ``INTERRUPTED``
    before its teardown; the first is still ``RUNNING``, a checkpoint may follow it)."""
    if job is None:
        return
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
    for technique in TECHNIQUES:
        technique.teardown(list(strategy.optimizers), job, interrupted)
