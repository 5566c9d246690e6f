"""Tensor parallelism as a technique (``tensor_parallel_size``, ``tensor_parallel_plan``): its settings
checked, its label, its transform of this rank's stages (the plan resolved on the unsplit module, carried
out on each stage module by ``apply.py``, or on each traced stage's graph by ``traced.py``) and, for
traced stages, its context around each step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource
from lightning_parallel.techniques.contract import Job, Technique
from lightning_parallel.techniques.tensor_parallel.apply import apply_plan
from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan
from lightning_parallel.techniques.tensor_parallel.traced import TensorParallelStep, split_traced


class TensorParallel(Technique):
    """Megatron-style tensor parallelism inside each stage, over the mesh's ``"tp"`` dimension.

    Example::

        ParallelPlan(devices=4, pipeline_size=2, tensor_parallel_size=2).label()   # 'pp 2x1 1f1b m=4 tp=2'
    """

    name = "tensor_parallel"
    fields = ("tensor_parallel_size", "tensor_parallel_plan")
    searched = ("tensor_parallel_size",)

    def normalized(self, plan: Any) -> dict[str, Any]:
        size, styles = plan.tensor_parallel_size, plan.tensor_parallel_plan
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
        if styles is None:
            return {}
        if not isinstance(styles, Mapping):
            raise TypeError(
                f"tensor_parallel_plan must be a dict {{module path pattern: ParallelStyle}} (as "
                f"parallelize_module takes), got {type(styles).__name__}"
            )
        if size == 1:
            raise ValueError(
                "tensor_parallel_plan splits layers over tensor-parallel ranks, but tensor_parallel_size=1: "
                "pass tensor_parallel_size > 1, or drop tensor_parallel_plan"
            )
        return {"tensor_parallel_plan": dict(styles)}

    def check(self, plan: Any) -> None:
        if plan.strategy != "pipeline" and plan.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 is modelled for strategy='pipeline' only")

    def label(self, plan: Any) -> str:
        return f" tp={plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else ""

    def stages(self, view: Any, job: Job) -> str | None:
        if job.tensor_plan is None:
            return None
        return apply(view, job.tensor_plan, job.mesh.device_mesh)

    def step_context(self, job: Job) -> TensorParallelStep | None:
        # Traced stages' graphs meet plain tensors with DTensors (stage modules of the user's run their
        # own modules' hooks, which make the DTensors they need).
        return TensorParallelStep() if job.tensor_plan is not None and job.stages.graphs else None


TECHNIQUE = TensorParallel()


def apply(stages: StageSource, plan: TensorPlan, device_mesh: DeviceMesh | None) -> str:
    """Split this rank's stages (the stage view) over the ``"tp"`` dimension of ``device_mesh``: each
    stage module's layers, or each traced stage's graph as it is prepared; the plan's table, for the log.

    Raises:
        ValueError: no device mesh (one process without a process group).

    Example::

        tensor_parallel.apply(runner.stages, plan, mesh.device_mesh)
    """
    if device_mesh is None:
        raise ValueError("tensor parallelism needs a process group (a device mesh) and there is none")
    mesh = device_mesh["tp"]
    if stages.graphs:
        split_traced(stages, plan, mesh)
    else:

        def split(stage: PreparedStage) -> None:
            apply_plan([stage.module], [[name for name, _ in stage.units]], plan, mesh)

        stages.each_stage(split)
    return plan.format_table()
