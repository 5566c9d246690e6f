"""Tensor parallelism as a technique (``tensor_parallel_size``, ``tensor_parallel_plan``): its settings
checked, its label, its transform of this rank's stages (the plan resolved on the unsplit module, carried
out on each stage module by ``apply.py``, or on each traced stage's graph by ``traced.py``), for traced
stages its context around each step, and its time in the planner (one split block measured in place on
the job, or the activation all-reduces). Its memory in the planner is the measurement's: the planner
measures one tensor-parallel rank's local model (``memory.py``), whose bytes are the rank's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource, UnsplitModel
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.job import Job
from lightning_parallel.techniques.ledgers import Line, TimeBench, TimeLedger
from lightning_parallel.techniques.tensor_parallel.apply import apply_plan
from lightning_parallel.techniques.tensor_parallel.plan import (
    TensorPlan,
    default_plan,
    traced_plan,
    user_plan,
)
from lightning_parallel.techniques.tensor_parallel.timing import (
    BlockTimes,
    TensorParallelTimes,
    measure_block,
)
from lightning_parallel.techniques.tensor_parallel.traced import (
    TensorParallelStep,
    split_traced,
    style_layouts,
)


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

    def before_split(self, plan: Any, model: UnsplitModel) -> TensorPlan | None:
        return resolve(plan, model)

    def stages(self, view: Any, job: Job) -> str | None:
        tensors = job.before_split.get(self.name)
        return None if tensors is None else apply(view, tensors, job.mesh.device_mesh)

    def step_context(self, job: Job) -> TensorParallelStep | None:
        # Traced stages' graphs meet plain tensors with DTensors (stage modules of the user's run their
        # own modules' hooks, which make the DTensors they need).
        return TensorParallelStep() if self.name in job.before_split and job.stages.graphs else None

    def measure(self, bench: TimeBench) -> TensorParallelTimes | None:
        """One block split over each tensor-parallel size's ranks, run as its stage runs it
        (:func:`measure_block`): what the local model's time leaves out (DTensor's dispatch, all-reduces)."""
        if bench.ranks < 2 or bench.mesh is None or not bench.samples or not bench.tensor_plans:
            return None
        blocks = {}
        for tp, plan in sorted(bench.tensor_plans.items()):
            if tp > 1 and bench.ranks % tp == 0:
                mesh = bench.mesh((bench.ranks // tp, tp), ("rest", "tp"))["tp"]
                blocks[tp] = measure_block(bench.samples[0], plan, mesh, bench)
        return TensorParallelTimes(blocks) if blocks else None

    def time(self, ledger: TimeLedger) -> None:
        """Measured in place (:class:`TensorParallelTimes`, ``plan="auto"``): each split unit (a block) costs
        what the real split block measured per micro-batch, forward and backward, its all-reduces and
        DTensor's dispatch included (the difference from the local model's unit charged as
        communication); a recomputed block's backward pays what the split block's measured more under
        checkpointing. Else from the links: one all-reduce per row-wise split layer in forward, as many in
        backward, each of the unit's output (activation-sized), over the tensor-parallel ranks."""
        tp, facts, mb = ledger.plan.tensor_parallel_size, ledger.facts, ledger.micro_batch
        if tp == 1:
            return
        measured = ledger.times.measured.get(self.name) if ledger.times is not None else None
        block = measured.blocks.get(tp) if isinstance(measured, TensorParallelTimes) else None
        for c in ledger.stages:
            if block is not None:
                split = [n for n in c.units if facts.tp_reduces.get(n, 0)]
                own = {n: ledger.times.units.get(n) or UnitTimes() for n in split}
                more = {n: max(0.0, block.forward.at(mb) - u.forward.at(mb)) for n, u in own.items()}
                forward = sum(more.values())
                backward = sum(max(0.0, block.backward.at(mb) - u.backward.at(mb)) for u in own.values())
                # Recomputed: as the split block measured under checkpointing (beyond the local unit's
                # forward, which recomputation charged).
                again = sum(_recomputed(block, own[n], mb) for n in split if n in ledger.recomputed)
                ledger.forward[c.index] += forward
                ledger.backward[c.index] += backward + again
                ledger.share(c.index, "communication", forward + backward)
                ledger.share(c.index, "recompute", again)
                continue
            outputs = [facts.probe.unit(n).outputs.at(mb) for n in c.units]
            reduces = sum(facts.tp_reduces.get(n, 0) * ledger.links.all_reduce(tp, nbytes)
                          for n, nbytes in zip(c.units, outputs))  # fmt: skip
            ledger.forward[c.index] += reduces
            ledger.backward[c.index] += reduces
            ledger.share(c.index, "communication", 2 * reduces)


TECHNIQUE = TensorParallel()


@dataclass(frozen=True)
class UnitTimes:
    """A unit with no time of its own measured: nothing to take out of a split block's."""

    forward: Line = field(default_factory=Line)
    backward: Line = field(default_factory=Line)


def _recomputed(block: BlockTimes, own: Any, mb: float) -> float:
    """A split block's forward run again in backward, beyond its local unit's forward."""
    again = block.recompute.at(mb) if block.recompute is not None else block.forward.at(mb)
    return max(0.0, again - own.forward.at(mb))


def resolve(plan: Any, model: UnsplitModel) -> TensorPlan | None:
    """The plan of the layers the source splits, read on the unsplit module (None without tensor
    parallelism): the user's ``tensor_parallel_plan``, else the default one (a traced forward's: a Hugging
    Face model's own ``base_model_tp_plan`` first), each style checked to be one a traced stage can place.

    Example::

        resolve(ParallelPlan(tensor_parallel_size=2), source.unsplit(module)).styles   # {path: style}
    """
    tp = plan.tensor_parallel_size
    if tp == 1:
        return None
    if not model.graphs:
        if plan.tensor_parallel_plan is not None:
            return user_plan(model.layers, model.path, tp, plan.tensor_parallel_plan)
        return default_plan(model.layers, model.path, tp)
    tensors = traced_plan(model.layers, tp, plan.tensor_parallel_plan)
    for path, style in tensors.styles.items():
        style_layouts(style, path)
    return tensors


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
