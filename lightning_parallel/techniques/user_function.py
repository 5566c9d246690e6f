"""A user's own ``parallelize_fn(stage_module, device_mesh)`` as a technique: run on each stage module
after tensor parallelism and before ``compile`` and data-parallel sharding (torchtitan's place for it).
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.techniques.contract import Job, Technique


class UserFunction(Technique):
    """``parallelize_fn``: the user's function on each stage module, changing it in place.

    Example::

        ParallelPlan(parallelize_fn=lambda stage, mesh: fully_shard(stage, mesh=mesh["dp_shard"]))
    """

    name, fields = "user_function", ("parallelize_fn",)

    def normalized(self, plan: Any) -> dict[str, Any]:
        if plan.parallelize_fn is not None and not callable(plan.parallelize_fn):
            raise TypeError(
                f"parallelize_fn must be a callable (stage_module, device_mesh) -> None, got "
                f"{plan.parallelize_fn!r}"
            )
        return {}

    def stages(self, view: Any, job: Job) -> str | None:
        if job.plan.parallelize_fn is not None:
            view.run_user_function(job.plan.parallelize_fn, job.mesh.device_mesh)
        return None


TECHNIQUE = UserFunction()
