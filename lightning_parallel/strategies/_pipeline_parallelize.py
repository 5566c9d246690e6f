"""PipelineStrategy's step after the split: parallelize each stage module on the device mesh.

Glue over :mod:`lightning_parallel.parallelize`: runs the user's ``parallelize_fn`` and FSDP2 on the
Sequential path's stage modules (on the traced path, FSDP2 on one root per stage), then points the
strategy's bookkeeping (parameter names, tied replicas) at the parameters FSDP put in their place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.parallelize.fsdp import DeferredReduceStage
from lightning_parallel.parallelize.stages import parallelize_stages
from lightning_parallel.parallelize.traced_fsdp import ShardedTracedStage, shard_traced_stage
from lightning_parallel.pipeline.split import SequentialStages
from lightning_parallel.pipeline.traced_split import TracedStages

if TYPE_CHECKING:
    from lightning_parallel.strategies._pipeline_build import PipelineParts
    from lightning_parallel.strategies._pipeline_config import PipelineConfig


def parallelize_parts(parts: PipelineParts, config: PipelineConfig, module: nn.Module) -> None:
    """Parallelize this rank's stage modules in place; every rank calls it (FSDP is collective-free here)."""
    if config.data_parallel != "fsdp" and config.parallelize_fn is None:
        return
    stages = parts.runner.stages
    mesh = parts.mesh
    before = dict(module.named_parameters())
    shard_mesh = mesh.data_parallel_mesh()
    if isinstance(stages, TracedStages):  # (refuse_traced_parallelize let only data_parallel="fsdp" by)
        stages.root = ShardedTracedStage(module)
        roots = [shard_traced_stage(stages.root, shard_mesh)]
    else:
        assert isinstance(stages, SequentialStages)
        roots = parallelize_stages(
            stages.modules, mesh.device_mesh, shard_mesh, config.data_parallel, config.parallelize_fn
        )
    after = dict(module.named_parameters())
    replaced = {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}
    parts.param_names = {replaced.get(id(p), p): n for p, n in parts.param_names.items()}
    parts.shared.rebind(replaced)
    parts.sharded = list(roots)
    if roots:
        stages.stage_cls = DeferredReduceStage
        shards, replicas = mesh.layout.dp_shard_size, mesh.layout.dp_replicate_size
        hybrid = f", replicated {replicas} times (HSDP)" if replicas > 1 else ""
        rank_zero_info(f"PipelineStrategy: each stage sharded with FSDP2 over {shards} ranks{hybrid}")
