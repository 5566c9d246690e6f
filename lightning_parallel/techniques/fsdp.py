"""FSDP2 inside pipeline stages: each stage's parameters sharded over its data-parallel ranks (ZeRO-3).

The technique (:data:`TECHNIQUE`, ``data_parallel="fsdp"``, ``data_parallel_shard_size``): its settings
checked, its label, its variant in the search, its transform of the stages (:func:`apply`; per stage
module :func:`shard_stage`) and its gradient reduction (:class:`ReduceScatter`); and :func:`memory`
(what it does to a stage's bytes: the planner's).

As torchtitan does: ``fully_shard`` on each block (a child of the stage that holds parameters), then
on the stage root, with ``reshard_after_forward=False`` (under a pipeline a stage runs forward once
per micro-batch: resharding after each would all-gather again for every micro-batch).

Gradients are reduce-scattered once per optimizer step: :class:`DeferredReduceStage` ends each
``schedule.step()`` without reducing (FSDP accumulates the unsharded gradients), and
:func:`reduce_gradients`, called once before the optimizer steps, reduce-scatters the whole
accumulation window's gradients. FSDP divides by the data-parallel size: a mean over the replicas,
as the all-reduce of plain replicas does.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.techniques._fsdp_internals import finish_backward
from lightning_parallel.techniques.contract import Job, Reduction, SearchOptions, Technique


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
        if search.shardable and plan.data_parallel == "replicate" and plan.data_parallel_size > 1:
            yield {"data_parallel": "fsdp"}

    def stages(self, view: Any, job: Job) -> str | None:
        return describe(job.mesh) if apply(view, job.plan, job.mesh, job.pin_memory) else None

    def reductions(self, job: Job) -> list[Reduction]:
        roots = job.stages.sharded()  # (a stage a user's parallelize_fn sharded too)
        return [ReduceScatter(roots)] if roots else []


TECHNIQUE = Fsdp()


class ReduceScatter(Reduction):
    """The FSDP2 roots' gradients reduce-scattered once per optimizer step (the whole window's), before
    the tied weights' replicas sum their shards.

    Example::

        ReduceScatter(roots)(finished=())
    """

    before_tied_sum = True

    def __init__(self, roots: Sequence[FSDPModule]) -> None:
        self.roots = list(roots)
        self.params = [p for root in self.roots for p in root.parameters()]

    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        reduce_gradients(self.roots)


def apply(stages: Any, plan: Any, mesh: Any, pin_memory: bool = False) -> list[nn.Module]:
    """Shard this rank's stages with FSDP2 when the plan says ``data_parallel="fsdp"`` (their shards on
    the host with ``offload="parameters"``, page-locked with ``pin_memory``); the stage modules that are
    FSDP roots (also those a user's ``parallelize_fn`` made roots), whose gradients are then reduced
    once per optimizer step (:class:`DeferredReduceStage`).

    Raises:
        ValueError: FSDP2 without a process group (no device mesh).

    Example::

        roots = fsdp.apply(runner.stages, plan, mesh)
    """
    if plan.data_parallel == "fsdp" and mesh.device_mesh is None:
        raise ValueError(
            'data_parallel="fsdp" needs a process group (a device mesh) and there is none: run '
            'under a Trainer with the pipeline strategy, or use data_parallel="replicate"'
        )
    sharding = plan.data_parallel == "fsdp"
    # FSDP2's offload (offload="parameters"): the shards, their gradients and the optimizer state on the host.
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if sharding and "parameters" in plan.offload else None
    roots = stages.shard(mesh.data_parallel_mesh() if sharding else None, policy)
    if roots:
        stages.use_stage_class(DeferredReduceStage)
    return roots


def describe(mesh: Any) -> str:
    """The log line for sharded stages: over how many ranks, replicated how many times (HSDP)."""
    shards = mesh.size("shard")
    replicas = mesh.size("gradients") // shards
    hybrid = f", replicated {replicas} times (HSDP)" if replicas > 1 else ""
    return f"each stage sharded with FSDP2 over {shards} ranks{hybrid}"


def shard_stage(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = False,
    offload_policy: OffloadPolicy | None = None,
) -> FSDPModule:
    """``fully_shard`` each block of ``module`` (its children with parameters), then ``module`` itself.

    Children that share a parameter with another child are left to the root (FSDP2 cannot shard one
    parameter in two modules). A 2-D ``mesh`` (replicate, shard) gives HSDP. ``offload_policy``:
    FSDP2's ``CPUOffloadPolicy`` keeps the shards, their gradients and the optimizer state on the host.

    Example::

        shard_stage(stage_module, mesh.device_mesh["dp_shard"])
        isinstance(stage_module, FSDPModule)      # True; its parameters are DTensors
    """
    blocks = [c for c in module.children() if any(True for _ in c.parameters())]
    owners: dict[int, int] = {}
    for block in blocks:
        for p in block.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    kwargs["offload_policy"] = offload_policy or OffloadPolicy()
    for block in blocks:
        if all(owners[id(p)] == 1 for p in block.parameters()):
            fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module  # type: ignore[return-value]


def sharded_roots(modules: Iterable[nn.Module]) -> list[FSDPModule]:
    """The stage modules that are FSDP roots (by this package or by a user's ``parallelize_fn``)."""
    return [m for m in modules if isinstance(m, FSDPModule)]


def reduce_gradients(roots: Iterable[FSDPModule]) -> None:
    """Reduce-scatter the gradients accumulated since the last call: once per optimizer step."""
    for root in roots:
        finish_backward(root, reduce=True)


def reshard(roots: Iterable[FSDPModule]) -> None:
    """Free the unsharded parameters (after a forward-only step; training steps reshard themselves).

    ``FSDPModule.reshard`` frees its own parameters only: every FSDP module under each root is asked.
    """
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


# torch workaround: https://github.com/pytorch/pytorch/pull/196641
#   canary: test_torch_schedules_keep_an_fsdp_module_s_gradient_sync_off
class DeferredReduceStage(PipelineStage):
    """A ``PipelineStage`` whose ``schedule.step()`` ends FSDP's backward without reducing gradients.

    torch 2.13 reduce-scatters at the end of every ``step()``; Lightning may accumulate several
    steps before the optimizer steps, so the reduction waits for :func:`reduce_gradients`.
    ``scale_grads`` stays the schedule's business (the strategy passes ``scale_grads=False``).
    """

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # Forward-only schedules call it too: nothing to end there (evaluation reshards by itself).
        if isinstance(self.submod, FSDPModule) and self.has_backward:
            finish_backward(self.submod, reduce=False)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


def shard_rows(rows: int, shards: int) -> int:
    """Rows of dim 0 on the fullest of ``shards`` FSDP2 shards (FSDP2 pads to equal whole rows).

    Example::

        >>> shard_rows(13, 2)
        7
    """
    return -(-rows // shards)


def shard_bytes(shape: Sequence[int], element_size: int, shards: int) -> int:
    """Bytes of the fullest of ``shards`` FSDP2 shards of a tensor: whole rows of dim 0, rounded up.

    Example::

        >>> shard_bytes((13, 8), 4, 2)   # 7 of the 13 rows
        224
    """
    if not shape:
        return element_size
    per_row = element_size
    for d in shape[1:]:
        per_row *= d
    return shard_rows(shape[0], shards) * per_row


@dataclass(frozen=True)
class ShardedBytes:
    """What FSDP2 does to a stage's parameter bytes on one rank: its shard, and the whole stage gathered.

    Under a pipeline the stage is gathered once per step (``reshard_after_forward=False``) and stays
    gathered from its first forward to the end of the schedule; its unsharded gradients live until the
    one reduce-scatter before the optimizer step (so the gradient bytes do not shrink until then).
    """

    shard: int
    gathered: int


def memory(tensors: Sequence[tuple[int, int]], shards: int) -> ShardedBytes:
    """The memory effect of sharding tensors given as ``(rows of dim 0, bytes)`` over ``shards`` ranks.

    Example::

        >>> memory([(13, 13 * 8 * 4), (8, 8 * 4)], 2)
        ShardedBytes(shard=240, gathered=448)
    """
    shard = sum(round(nbytes * shard_rows(rows, shards) / rows) for rows, nbytes in tensors)
    return ShardedBytes(shard, sum(nbytes for _, nbytes in tensors))
