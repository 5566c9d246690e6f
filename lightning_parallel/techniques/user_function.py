"""A user's own ``parallelize_fn(stage_module, device_mesh)`` as a technique: run on each stage module
after tensor parallelism and before ``compile`` and data-parallel sharding (torchtitan's place for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_parallel.pipeline.stage_source import UnsplitModel
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.job import Job


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

    def before_split(self, plan: Any, model: UnsplitModel) -> None:
        if plan.parallelize_fn is not None and model.graphs:
            raise ValueError(
                "parallelize_fn needs the stage modules of a split nn.Sequential, but this module is split "
                "by tracing its forward: a traced stage is an export graph that reads its weights directly, "
                "with no modules of yours to parallelize. Hold the layers in one top-level nn.Sequential, or "
                'drop parallelize_fn (data_parallel="fsdp" shards traced stages too)'
            )

    def stages(self, view: Any, job: Job) -> str | None:
        fn = job.plan.parallelize_fn
        if fn is None:
            return None
        if view.graphs:  # (refused before the split, with the reason)
            raise RuntimeError("internal error: parallelize_fn reached a traced stage")
        view.each_stage(lambda stage: run(fn, stage.module, job.mesh.device_mesh))
        return None


TECHNIQUE = UserFunction()


def run(fn: Callable[..., Any], module: nn.Module, device_mesh: Any) -> None:
    """``fn(module, device_mesh)``, which must change the stage module in place.

    Raises:
        TypeError: ``fn`` returned another module (the stage would not run it).

    Example::

        run(lambda stage, mesh: None, stage_module, None)
    """
    returned = fn(module, device_mesh)
    if returned is not None and returned is not module:
        raise TypeError(
            f"parallelize_fn returned a new {type(returned).__name__}: it must change the stage module it "
            f"receives in place (fully_shard, parallelize_module, ...) and return it or None"
        )
