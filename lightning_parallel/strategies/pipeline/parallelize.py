"""PipelineStrategy's step after the split: parallelize each stage module on the device mesh.

Glue over :mod:`lightning_parallel.parallelize`: resolves the tensor-parallel plan on the unsplit
module, then runs tensor parallelism, the user's ``parallelize_fn``, ``torch.compile`` of the blocks and
FSDP2 on the Sequential path's stage modules (on the traced path: tensor parallelism on the held
modules, whose graphs then run on DTensors, each stage's program compiled once prepared, and FSDP2 on
one root per stage), and points the strategy's
bookkeeping (parameter names, tied replicas) at the parameters they put in their place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.parallelize.compile import block_type
from lightning_parallel.parallelize.fsdp import DeferredReduceStage
from lightning_parallel.parallelize.stages import parallelize_stages
from lightning_parallel.parallelize.tensor import TensorPlan, default_plan, traced_plan, user_plan
from lightning_parallel.parallelize.tensor_apply import apply_held_styles
from lightning_parallel.pipeline.split import SequentialStages, find_sequential
from lightning_parallel.traced.fsdp import ShardedTracedStage, shard_traced_stage
from lightning_parallel.traced.split import TracedStages
from lightning_parallel.traced.tensor_parallel import style_layouts

if TYPE_CHECKING:
    from lightning_parallel.strategies.pipeline.build import PipelineParts
    from lightning_parallel.strategies.pipeline.config import PipelineConfig


def tensor_plan(module: nn.Module, config: PipelineConfig) -> tuple[str, TensorPlan] | None:
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


def compiled_block_type(module: nn.Module, config: PipelineConfig) -> type | None:
    """On the Sequential path, the class of the layers ``compile=`` compiles (read before the split).

    The Sequential's repeated blocks (its most frequent class), or every layer (None) when no class
    repeats; None on the traced path too, which compiles each stage's program whole.
    """
    found = find_sequential(module, config.module_name) if config.split_points is None else None
    return block_type(list(found[1])) if found is not None else None


def parallelize_parts(
    parts: PipelineParts,
    config: PipelineConfig,
    module: nn.Module,
    plan: tuple[str, TensorPlan] | None = None,
    blocks: type | None = None,
) -> None:
    """Parallelize this rank's stage modules in place; every rank calls it (collectives over tp only).

    ``blocks``: the class of the layers to compile (:func:`compiled_block_type`), if ``config.compile``.
    """
    stages = parts.runner.stages
    traced = isinstance(stages, TracedStages)
    if config.compile is not None and traced:  # compiled as each program is prepared
        stages.compile_options = config.compile
        rank_zero_info(
            f"PipelineStrategy: each stage's program is compiled (torch.compile, {config.compile})"
        )
    nothing_else = config.data_parallel != "fsdp" and config.parallelize_fn is None and plan is None
    if nothing_else and (config.compile is None or traced):
        return
    mesh = parts.mesh
    before = dict(module.named_parameters())
    shard_mesh = mesh.data_parallel_mesh()
    seq_name, tp_plan = plan if plan is not None else ("", None)
    if isinstance(stages, TracedStages):  # refuse_traced_parallelize let only tp and fsdp by
        roots = []
        if tp_plan is not None:
            held = apply_held_styles(module, tp_plan, mesh.device_mesh["tp"])
            stages.split_over(mesh.device_mesh["tp"], held)
        if config.data_parallel == "fsdp":
            stages.root = ShardedTracedStage(module, stages.tensor_parallel_mesh)
            roots = [shard_traced_stage(stages.root, shard_mesh)]
    else:
        assert isinstance(stages, SequentialStages)
        names = [[f"{seq_name}.{c}" for c, _ in m.named_children()] for m in stages.modules]
        roots = parallelize_stages(
            stages.modules,
            mesh.device_mesh,
            shard_mesh,
            config.data_parallel,
            config.parallelize_fn,
            tp_plan,
            names,
            config.compile,
            blocks,
        )
    after = dict(module.named_parameters())
    replaced = {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}
    parts.param_names = {replaced.get(id(p), p): n for p, n in parts.param_names.items()}
    parts.shared.rebind(replaced)
    parts.sharded = list(roots)
    if tp_plan is not None:
        rank_zero_info(f"PipelineStrategy: {tp_plan.format_table()}")
    if config.compile is not None and not traced:
        what = f"its {blocks.__name__} layers" if blocks is not None else "its layers"
        rank_zero_info(
            f"PipelineStrategy: each stage compiles {what} in place (torch.compile, {config.compile})"
        )
    if roots:
        stages.stage_cls = DeferredReduceStage
        shards, replicas = mesh.layout.dp_shard_size, mesh.layout.dp_replicate_size
        hybrid = f", replicated {replicas} times (HSDP)" if replicas > 1 else ""
        rank_zero_info(f"PipelineStrategy: each stage sharded with FSDP2 over {shards} ranks{hybrid}")
