"""Tensor parallelism as a technique (``tensor_parallel_size``, ``tensor_parallel_plan``): its settings
checked, its label, and its transform of this rank's stages (the plan the stage source resolved on the
unsplit module, carried out by ``apply.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_parallel.techniques.contract import Job, Technique
from lightning_parallel.techniques.tensor_parallel.apply import apply


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
        return apply(view, job.tensor_plan, job.mesh.device_mesh, job.module)


TECHNIQUE = TensorParallel()
