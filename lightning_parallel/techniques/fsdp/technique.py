"""The FSDP2 technique (``data_parallel="fsdp"``, ``data_parallel_shard_size``): what the plan, the set-up
and the planner ask of it, each answered by a member of :class:`Fsdp`.

Its settings checked and its refusals (one rank holding two stages that use one weight:
:func:`refuse_shared_on_one_rank`), its label, its variant in the search, its transform of the stages
and its gradient reduction (the mechanics: ``sharding.py``, and ``traced.py`` for a traced stage's one
root); for the planner, what it does to a rank's bytes (``memory.py``) and to its step's time (the
all-gather before the first forward, the reduce-scatter after the schedule; measured in place by
``timing.py``). This module decides; the others do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_parallel.pipeline.stage_source import UnsplitModel
from lightning_parallel.techniques.contract import SearchOptions, Technique
from lightning_parallel.techniques.fsdp.memory import memory, state_bytes
from lightning_parallel.techniques.fsdp.sharding import ReduceScatter, apply, sharded_roots
from lightning_parallel.techniques.fsdp.timing import FsdpTimes, measure_units
from lightning_parallel.techniques.job import Job, Reduction
from lightning_parallel.techniques.ledgers import MemoryLedger, TimeBench, TimeLedger


class Fsdp(Technique):
    """FSDP2 (``data_parallel="fsdp"``): each stage sharded over its data-parallel ranks, HSDP with a
    ``data_parallel_shard_size`` below them.

    Example::

        ParallelPlan(devices=8, pipeline_size=2, data_parallel="fsdp", data_parallel_shard_size=2).label()
        # 'pp 2x4 1f1b m=4 +hsdp 2x2'
    """

    name, fields, searched = "fsdp", ("data_parallel_shard_size",), ("data_parallel_shard_size",)

    def normalized(self, plan: Any) -> dict[str, Any]:
        shards = plan.data_parallel_shard_size
        if shards is not None:
            if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
                raise ValueError(f"data_parallel_shard_size must be a positive int, got {shards!r}")
            if plan.data_parallel != "fsdp":
                raise ValueError(
                    f"data_parallel_shard_size={shards} shards stages with FSDP2, but data_parallel="
                    f"{plan.data_parallel!r}: use data_parallel='fsdp', or drop data_parallel_shard_size"
                )
        return {}

    def check(self, plan: Any) -> None:
        if plan.data_parallel != "fsdp":
            return
        if plan.strategy != "pipeline":
            raise ValueError(
                f"data_parallel='fsdp' shards the stages of a pipeline, but strategy={plan.strategy!r}: use "
                f"strategy='pipeline' (pipeline_size=1 for FSDP alone)"
            )
        if plan.devices is not None:  # the rank grid refuses a shard size that does not divide the replicas
            plan.layout()

    def label(self, plan: Any) -> str:
        if plan.data_parallel != "fsdp":
            return ""
        replicas = plan.data_parallel_size // plan.shard_size
        return f" +hsdp {replicas}x{plan.shard_size}" if replicas > 1 else " +fsdp"

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        yield {}
        # (the planner models FSDP2's units as the layers of a split nn.Sequential: it tries no other)
        if (
            search.layout == "sequential"
            and plan.data_parallel == "replicate"
            and plan.layout().size("gradients") > 1  # (the replicas x the sequence ranks, which join)
        ):
            yield {"data_parallel": "fsdp"}

    def before_split(self, plan: Any, model: UnsplitModel) -> None:
        if plan.data_parallel == "fsdp" and model.graphs and plan.stages_per_rank > 1:
            raise ValueError(
                f'data_parallel="fsdp" with stages_per_rank={plan.stages_per_rank} is not supported for a '
                f"traced forward: each traced stage is sharded as one FSDP root holding this rank's modules, "
                f"so a rank can hold one stage. Use stages_per_rank=1 (schedule='1f1b' or 'gpipe'), or hold "
                f"the layers in one top-level nn.Sequential"
            )

    def stages(self, view: Any, job: Job) -> str | None:
        if job.plan.data_parallel == "fsdp" and job.table is not None:
            refuse_shared_on_one_rank(job.table)
        return describe(job.mesh) if apply(view, job.plan, job.mesh, job.pin_memory) else None

    def reductions(self, job: Job) -> list[Reduction]:
        roots = sharded_roots(job.stages.modules)  # (a stage a user's parallelize_fn sharded too)
        return [ReduceScatter(roots)] if roots else []

    def memory(self, ledger: MemoryLedger) -> None:
        """The rank's shard of its stages' parameters, and the whole stages gathered for the step
        (:class:`ShardedBytes`); the shard of the optimizer state; the gradients it keeps after the
        reduce-scatter a shard too (its unsharded ones stay in the ``gradients`` column until then)."""
        plan = ledger.plan
        if plan.data_parallel != "fsdp":
            return
        tensors = [ledger.facts.tensors[k] for k in ledger.keys]
        shards = plan.layout().size("shard")  # (the data-parallel shards x the sequence ranks, which join)
        sharded = memory([(t.rows, t.nbytes) for t in tensors], shards)
        ledger.device["parameters"] -= sharded.gathered - sharded.shard
        ledger.device["gathered"] += sharded.gathered
        # The state of each parameter's shard (whole rows; per-tensor state such as Adam's ``step`` stays
        # whole), in place of the whole parameter's.
        ledger.device["optimizer"] -= ledger.facts.state_of(ledger.keys) - state_bytes(tensors, shards)
        ledger.reduced_gradients = memory([(t.rows, t.grad) for t in tensors], shards).shard

    def measure(self, bench: TimeBench) -> FsdpTimes | None:
        """FSDP2 in place: each sampled unit (a block, the smallest unit) under ``fully_shard`` over every
        rank of the job, as a stage shards it, against a plain copy (see :func:`measure_units`)."""
        if bench.ranks < 2 or bench.layout != "sequential" or bench.mesh is None or not bench.samples:
            return None  # (the search tries FSDP2 on a split nn.Sequential only)
        return measure_units(bench)

    def time(self, ledger: TimeLedger) -> None:
        """Measured in place (:class:`FsdpTimes`, ``plan="auto"``): per FSDP2 unit of the rank's stages
        (each layer of a split Sequential, and each stage's root, with no parameters of its own), its
        all-gather and the end of its backward per batch, FSDP2's hooks and gradient accumulation on
        each micro-batch's forward and backward, its reduce-scatter per optimizer step, each a line in the
        unit's bytes. Else from the links: the all-gather of the rank's stages before the first forward,
        after the schedule one reduce-scatter per unit. HSDP adds an all-reduce of the shard over the
        replicas; the optimizer steps the shard."""
        plan, links = ledger.plan, ledger.links
        if plan.data_parallel != "fsdp":
            return
        shards, replicas = plan.layout().size("shard"), plan.data_parallel_size // plan.shard_size
        units = sum(len(c.units) + 1 for c in ledger.stages)
        grads = ledger.unreduced
        measured = ledger.times.measured.get(self.name) if ledger.times is not None else None
        if isinstance(measured, FsdpTimes):
            measured.charge(ledger, shards)
        else:
            nbytes = sum(ledger.facts.tensors[k].nbytes for k in ledger.keys)
            ledger.start += links.all_gather(shards, nbytes) + links.more_messages(shards, units)
            ledger.tail["communication"] += links.reduce_scatter(shards, grads) + links.more_messages(
                shards, units
            )
        ledger.tail["communication"] += links.all_reduce(replicas, grads / shards) + 2 * links.more_messages(
            replicas, units
        )
        ledger.unreduced = 0.0
        ledger.step_elements /= shards


TECHNIQUE = Fsdp()


def refuse_shared_on_one_rank(table: Any) -> None:
    """Refuse FSDP2 where one rank holds two stages that use one parameter (a tied weight).

    Every stage is its own FSDP2 root, and FSDP2 cannot shard one parameter in two roots: each root
    would put its own sharded copy in the tied weight's place, each taking only its stage's half of the
    gradient (their replicas across ranks are summed by ``grads/tied.py``, two copies on one rank are
    not), and the optimizer state of one copy would have no name in a checkpoint. Every rank reads the
    same stage table (``StagePlan``), so every rank refuses together.

    Raises:
        ValueError: naming the parameter, its stages and the rank, with the fixes.

    Example::

        refuse_shared_on_one_rank(job.table)   # a V schedule, a tied embedding and head: refused
    """
    users: dict[str, list[int]] = {}
    for index, stage in enumerate(table.stages):
        for name in stage.parameters:
            users.setdefault(name, []).append(index)
    for name, stages in sorted(users.items()):
        ranks = [table.pp_rank_of(s) for s in stages]
        twice = next((r for r in ranks if ranks.count(r) > 1), None)
        if twice is not None:
            held = [s for s, r in zip(stages, ranks) if r == twice]
            raise ValueError(
                f'data_parallel="fsdp" cannot shard {name!r}: stages {held} use it and pipeline rank '
                f"{twice} holds them all, and FSDP2 shards one parameter in one stage only (two sharded "
                f"copies would each take part of its gradient). Use a schedule that puts those stages on "
                f"different pipeline ranks (schedule='1f1b' or 'gpipe', or a looped schedule with "
                f"pipeline_size >= 2; not 'zbv' or 'dualpipev', nor pipeline_size=1 with stages_per_rank > "
                f"1), data_parallel='replicate' or 'zero1', or untie the weight"
            )


def describe(mesh: Any) -> str:
    """The log line for sharded stages: over how many ranks, replicated how many times (HSDP)."""
    shards = mesh.size("shard")
    replicas = mesh.size("gradients") // shards
    hybrid = f", replicated {replicas} times (HSDP)" if replicas > 1 else ""
    return f"each stage sharded with FSDP2 over {shards} ranks{hybrid}"
