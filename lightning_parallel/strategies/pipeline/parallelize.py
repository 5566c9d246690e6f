"""PipelineStrategy's step after the split: parallelize each stage module on the device mesh.

Glue over :mod:`lightning_parallel.parallelize`: resolves the tensor-parallel plan on the unsplit
module, then asks the stage source's glue (:mod:`~lightning_parallel.strategies.pipeline.source_glue`)
to run tensor parallelism, the user's ``parallelize_fn``, ``torch.compile`` and FSDP2 on its stages,
and points the strategy's bookkeeping (parameter names, tied replicas) at the parameters they put in
their place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.pipeline.split import find_sequential
from lightning_parallel.strategies.pipeline.source_glue import ParallelizeRequest
from lightning_parallel.techniques.fsdp import DeferredReduceStage
from lightning_parallel.techniques.tensor_parallel.plan import (
    TensorPlan,
    default_plan,
    traced_plan,
    user_plan,
)
from lightning_parallel.traced.tensor_parallel import style_layouts

if TYPE_CHECKING:
    from lightning_parallel.plan.parallel_plan import ParallelPlan
    from lightning_parallel.strategies.pipeline.build import PipelineParts


def tensor_plan(module: nn.Module, config: ParallelPlan) -> tuple[str, TensorPlan] | None:
    """The tensor-parallel plan (read on the unsplit module, before the split), or None.

    On the Sequential path: the split Sequential's layers (``"layers"``, the plan). On the traced path
    (``""``, the plan): the user's plan, else a Hugging Face model's own ``base_model_tp_plan``, else
    the default plan of the block list; every style checked to be one a traced stage can place.
    The same on every rank (a pure function of the module): its errors are raised by all ranks alike.
    """
    if config.tensor_parallel_size == 1:
        return None
    tp = config.tensor_parallel_size
    found = find_sequential(module, config.module_name) if config.split_points is None else None
    if found is not None:
        name, seq = found
        if config.tensor_parallel_plan is not None:
            return name, user_plan(seq, name, tp, config.tensor_parallel_plan)
        return name, default_plan(seq, name, tp)
    plan = traced_plan(module, tp, config.tensor_parallel_plan)
    for path, style in plan.styles.items():
        style_layouts(style, path)
    return "", plan


def parallelize_parts(
    parts: PipelineParts,
    config: ParallelPlan,
    module: nn.Module,
    plan: tuple[str, TensorPlan] | None = None,
) -> None:
    """Parallelize this rank's stages in place (through the source's glue); every rank calls it
    (collectives over tp only)."""
    asked = config.data_parallel == "fsdp" or config.parallelize_fn is not None or config.compile is not None
    if not asked and plan is None:
        return
    mesh = parts.mesh
    tp_plan = plan[1] if plan is not None else None
    request = ParallelizeRequest(
        mesh.device_mesh, mesh.data_parallel_mesh(), config.data_parallel, config.parallelize_fn,
        tp_plan, config.compile,
    )  # fmt: skip
    before = dict(module.named_parameters())
    roots = parts.glue.parallelize(module, request)
    after = dict(module.named_parameters())
    replaced = {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}
    if replaced:
        parts.param_names = {replaced.get(id(p), p): n for p, n in parts.param_names.items()}
        parts.shared.rebind(replaced)
    parts.sharded = list(roots)
    if tp_plan is not None:
        rank_zero_info(f"PipelineStrategy: {tp_plan.format_table()}")
    if config.compile is not None:
        rank_zero_info(f"PipelineStrategy: {parts.glue.compiled(config.compile)}")
    if roots:
        parts.runner.stages.use_stage_class(DeferredReduceStage)
        shards, replicas = mesh.layout.dp_shard_size, mesh.layout.dp_replicate_size
        hybrid = f", replicated {replicas} times (HSDP)" if replicas > 1 else ""
        rank_zero_info(f"PipelineStrategy: each stage sharded with FSDP2 over {shards} ranks{hybrid}")
