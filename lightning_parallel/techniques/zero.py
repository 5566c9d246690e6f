"""ZeRO-1 inside the pipeline: a stage's optimizer state sharded over the replicas of that stage.

The technique (:data:`TECHNIQUE`, ``data_parallel="zero1"``): its refusal, its label, its variant in the
search and its transform of the optimizers (right after they are built: each wrapped over this stage's
replicas, :func:`~lightning_parallel.optim.sharded.shard_optimizer_state`); for the planner, the
optimizer-state bytes on the fullest replica (:func:`memory`, :meth:`Zero.memory`) and the broadcast of
the updated parameters after a step of a share of them (:meth:`Zero.time`).

Each data-parallel replica of a stage holds the full parameters and (after the gradient
all-reduce) the full gradients, but torch's ``ZeroRedundancyOptimizer`` keeps the optimizer state
of only its share of the parameters, steps that share, and broadcasts the updated parameters to
the other replicas. The optimizer state per rank falls as 1 / replicas. Checkpoints stay whole
(:func:`~lightning_parallel.optim.sharded.consolidate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.optim.sharded import shard_optimizer_state
from lightning_parallel.techniques.contract import SearchOptions, Technique
from lightning_parallel.techniques.job import Job
from lightning_parallel.techniques.ledgers import MemoryLedger, TimeLedger


class Zero(Technique):
    """ZeRO-1 (``data_parallel="zero1"``): the optimizer state sharded over each stage's replicas.

    Example::

        ParallelPlan(devices=4, pipeline_size=2, data_parallel="zero1").label()   # 'pp 2x2 1f1b m=4 +zero'
    """

    name = "zero"

    def check(self, plan: Any) -> None:
        # torch workaround: no upstream issue found
        #   canary: test_zero_redundancy_optimizer_steps_dtensor_parameters
        size = plan.tensor_parallel_size
        if size > 1 and plan.data_parallel == "zero1":
            raise ValueError(
                f"tensor_parallel_size={size} with data_parallel='zero1' is not supported: torch's "
                f"ZeroRedundancyOptimizer broadcasts plain tensors, not the DTensor slices of split weights. "
                f"Use data_parallel='fsdp' (shards parameters, gradients and optimizer state) or 'replicate'"
            )

    def label(self, plan: Any) -> str:
        return " +zero" if plan.data_parallel == "zero1" else ""

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        yield {}
        # (over the replicas and the sequence ranks, which join the optimizer-state shards)
        if plan.data_parallel == "replicate" and plan.layout().size("optimizer_shard") > 1:
            yield {"data_parallel": "zero1"}

    def optimizers(self, optimizers: list[torch.optim.Optimizer], job: Job) -> list[torch.optim.Optimizer]:
        if job.plan.data_parallel != "zero1":
            return optimizers
        if "optimizer" not in job.plan.offload:  # (offloaded: its host step shards itself)
            optimizers = apply(optimizers, job.schedulers, job.mesh.group("optimizer_shard"))
        shards = job.mesh.size("optimizer_shard")
        job.info(f"PipelineStrategy: optimizer state sharded over {shards} replica(s)")
        return optimizers

    def memory(self, ledger: MemoryLedger) -> None:
        """The optimizer state of the fullest replica, as torch shards it (:func:`memory`)."""
        if ledger.plan.data_parallel != "zero1":
            return
        dp, facts = ledger.plan.layout().size("optimizer_shard"), ledger.facts  # (the sequence ranks join)
        if dp == 1:
            return
        mine = set(ledger.keys)
        groups = [
            [(facts.tensors[k].numel, facts.state_of([k])) for k in g if k in mine] for g in facts.group_order
        ]
        ledger.device["optimizer"] -= facts.state_of(ledger.keys) - memory(groups, dp)

    def time(self, ledger: TimeLedger) -> None:
        """ZeroRedundancyOptimizer broadcasts each updated parameter from its owner (each on the links'
        measured broadcast curve; given links: an all-gather of them all and every tensor's latency); each
        replica steps a share of the elements and tensors."""
        if ledger.plan.data_parallel != "zero1":
            return
        dp, links = ledger.plan.layout().size("optimizer_shard"), ledger.links
        trainable = [ledger.facts.tensors[k] for k in ledger.keys if ledger.facts.tensors[k].grad]
        params, tensors = sum(t.nbytes for t in trainable), len(trainable)
        if "broadcast" in links.curves:  # (torch's: one broadcast per parameter, from its owner)
            ledger.tail["communication"] += sum(links.broadcast(dp, t.nbytes) for t in trainable)
        else:
            ledger.tail["communication"] += links.all_gather(dp, params) + links.more_messages(dp, tensors)
        ledger.step_elements, ledger.step_tensors = ledger.step_elements / dp, ledger.step_tensors / dp


TECHNIQUE = Zero()


def apply(
    optimizers: list[torch.optim.Optimizer], schedulers: Iterable[Any], group: dist.ProcessGroup | None
) -> list[torch.optim.Optimizer]:
    """Each optimizer as a ZeroRedundancyOptimizer over this stage's replicas ``group`` (right after
    creation); the LR ``schedulers`` follow the new optimizers. One replica: the optimizers unchanged.

    Example::

        group = mesh.group("optimizer_shard")
        optimizers = zero.apply(optimizers, [c.scheduler for c in scheduler_configs], group)
    """
    schedulers = list(schedulers)
    return [shard_optimizer_state(o, group, schedulers) for o in optimizers]


def shard_sizes(group_numels: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Elements of optimizer-managed parameters each replica holds, as ``ZeroRedundancyOptimizer`` splits.

    torch's rule (2.13): per param group, largest tensor first, each to the replica with the fewest
    elements so far (counts carried across groups; ties to the lowest rank). A tensor is never split,
    so a few large tensors shard unevenly. The memory planner uses it to predict the shard sizes.

    Example::

        >>> shard_sizes([[1024, 64, 32, 2]], 2)
        [1024, 98]
    """
    sizes = [0] * world_size
    for group, owners in zip(group_numels, shard_owners(group_numels, world_size)):
        for n, rank in zip(group, owners):
            sizes[rank] += int(n)
    return sizes


def shard_owners(group_numels: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """The replica that holds each parameter's state, per group, in the groups' order (see shard_sizes).

    Example::

        >>> shard_owners([[32, 1024], [64]], 2)
        [[1, 0], [1]]
    """
    sizes = [0] * world_size
    owners = []
    for numels in group_numels:
        group_owners = [0] * len(numels)
        # sorted() is stable: equal sizes keep their order, as in torch's sort of the group's params.
        for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):
            rank = sizes.index(min(sizes))
            group_owners[i] = rank
            sizes[rank] += int(numels[i])
        owners.append(group_owners)
    return owners


def memory(groups: Sequence[Sequence[tuple[int, int]]], replicas: int) -> int:
    """Optimizer-state bytes on the fullest of ``replicas``, each parameter given as ``(numel, state
    bytes)`` per param group, its state owned by the replica torch's rule gives it (:func:`shard_owners`).

    Example::

        >>> memory([[(1024, 8192), (64, 512), (32, 256)]], 2)   # the large tensor alone on replica 0
        8192
    """
    per_replica = [0] * replicas
    owners = shard_owners([[numel for numel, _ in group] for group in groups], replicas)
    for group, group_owners in zip(groups, owners):
        for (_, state), owner in zip(group, group_owners):
            per_replica[owner] += state
    return max(per_replica)
