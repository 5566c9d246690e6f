"""The techniques on this rank's stages after the split, in torchtitan's order.

Whatever changes a stage's computation first: tensor parallelism, then a user's own ``parallelize_fn``
(recomputation is installed before, at the split), then ``torch.compile`` of the blocks, then
data-parallel sharding over the stage's data-parallel ranks (FSDP2 on top of tensor-parallel DTensors is
2-D: each rank holds a data-parallel shard of its tensor-parallel slice). Plain replicas and ZeRO-1
leave the stages as they are (the optimizer step averages their gradients; ZeRO-1 wraps the optimizers).

Each technique says what to do; the stage source does it to its own stages (the
:class:`~lightning_parallel.pipeline.stage_source.StageSource` methods), so nothing here asks which
source it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.pipeline.stage_source import StageSource
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.techniques import compile as compiling
from lightning_parallel.techniques import fsdp
from lightning_parallel.techniques.tensor_parallel import apply as tensor_parallel


@dataclass
class Parallelized:
    """What parallelizing did: the stage modules that are FSDP2 roots (they reduce their own gradients)
    and one line per technique applied, for the log."""

    roots: list[nn.Module] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parallelize(
    stages: StageSource, plan: ParallelPlan, mesh: PipelineMesh, module: nn.Module, tensor_plan: Any = None
) -> Parallelized:
    """Apply ``plan``'s techniques to this rank's ``stages`` in torchtitan's order (every rank calls it:
    tensor parallelism and FSDP2 are collective over their mesh dimensions).

    Args:
        stages: this rank's stage source (the runner's).
        plan: the plan (``parallelize_fn``, ``compile``, ``data_parallel``).
        mesh: this rank's mesh (``None`` device mesh: one process without a process group).
        module: the LightningModule after the split (this rank's modules).
        tensor_plan: the tensor-parallel plan resolved on the unsplit module, or None.

    Raises:
        ValueError: tensor parallelism or FSDP2 without a process group.
        TypeError: ``parallelize_fn`` returned another module.

    Example::

        done = parallelize(runner.stages, plan, mesh, module, source.tensor_plan(module, plan))
        done.roots      # the FSDP2 roots
    """
    done = Parallelized()
    if tensor_plan is not None:
        done.notes.append(tensor_parallel.apply(stages, tensor_plan, mesh.device_mesh, module))
    if plan.parallelize_fn is not None:
        stages.run_user_function(plan.parallelize_fn, mesh.device_mesh)
    if plan.compile is not None:
        done.notes.append(compiling.apply(stages, plan.compile))
    done.roots = fsdp.apply(stages, plan, mesh)
    if done.roots:
        done.notes.append(fsdp.describe(mesh))
    return done
