"""Tensor parallelism as a technique (``tensor_parallel_size``, ``tensor_parallel_plan``): its settings
checked, its label, its transform of this rank's stages (the plan the stage source resolved on the
unsplit module, carried out by ``apply.py``), and its time in the planner (the activation all-reduces).
Its memory in the planner is the measurement's: the planner measures one tensor-parallel rank's local
model (``memory.py``), whose bytes are the rank's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_parallel.techniques.contract import Job, Technique, TimeLedger
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

    def time(self, ledger: TimeLedger) -> None:
        """The all-reduces of each split block: one per row-wise split layer in forward, as many in
        backward, each of the unit's output (activation-sized), over the tensor-parallel ranks."""
        tp, facts, mb = ledger.plan.tensor_parallel_size, ledger.facts, ledger.micro_batch
        if tp == 1:
            return
        for c in ledger.stages:
            outputs = [facts.probe.unit(n).outputs.at(mb) for n in c.units]
            reduces = sum(facts.tp_reduces.get(n, 0) * ledger.links.all_reduce(tp, nbytes)
                          for n, nbytes in zip(c.units, outputs))  # fmt: skip
            ledger.forward[c.index] += reduces
            ledger.backward[c.index] += reduces
            ledger.share(c.index, "communication", 2 * reduces)


TECHNIQUE = TensorParallel()
