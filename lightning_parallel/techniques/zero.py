"""ZeRO-1 inside the pipeline: a stage's optimizer state sharded over the replicas of that stage.

Entry points: :func:`apply` (the optimizers of this rank's stages, right after they are built) and
:func:`memory` (the optimizer-state bytes on the fullest replica: the planner's).

Each data-parallel replica of a stage holds the full parameters and (after the gradient
all-reduce) the full gradients, but torch's ``ZeroRedundancyOptimizer`` keeps the optimizer state
of only its share of the parameters, steps that share, and broadcasts the updated parameters to
the other replicas. The optimizer state per rank falls as 1 / replicas.

Checkpoints stay whole: :func:`consolidate` gathers the state on replica 0 (a collective over the
replica group), where ``optimizer.state_dict()`` is then the full, unsharded state in torch's usual
layout. A full state loads with ``optimizer.load_state_dict(full)`` on every replica, each keeping
its share, so a checkpoint moves between any shapes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_parallel.distributed.dtensors import local


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer,
    group: dist.ProcessGroup | None,
    schedulers: Iterable[Any] = (),
    optimizer_class: type | None = None,
) -> torch.optim.Optimizer:
    """Wrap a freshly built optimizer into a ``ZeroRedundancyOptimizer`` over ``group``.

    The new optimizer has the same class, param groups and hyper-parameters; every scheduler in
    ``schedulers`` that drives ``optimizer`` is pointed at the new one. A group of one rank (or no
    process group) returns ``optimizer`` unchanged: there is nothing to shard.

    Args:
        optimizer: as ``configure_optimizers`` built it, before any step.
        group: the replicas of this rank's stage (``PipelineMesh.dp_group``).
        schedulers: LR schedulers (``torch.optim.lr_scheduler`` objects) to retarget.
        optimizer_class: the class each replica builds over its shard (default: ``optimizer``'s own;
            offload passes it made host-stepping), taking ``optimizer``'s defaults.

    Raises:
        ValueError: the optimizer has already stepped (its state would be lost), or is a wrapper.

    Example::

        optimizer = shard_optimizer_state(torch.optim.AdamW(stage.parameters()), mesh.dp_group, [sched])
        ...
        consolidate(optimizer)             # every replica of the stage
        if mesh.dp_rank == 0:
            full = optimizer.state_dict()  # the unsharded state
    """
    if not dist.is_initialized() or group is None or dist.get_world_size(group) == 1:
        return optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if any(optimizer.state.values()):
        raise ValueError(
            f"shard_optimizer_state got a {type(optimizer).__name__} that already holds state: shard it "
            f"right after it is built, before its first step"
        )
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    cls = optimizer_class or type(optimizer)
    sharded = ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=group, **defaults)
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            retarget_scheduler(scheduler, sharded)
    return sharded


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer a ``LightningOptimizer`` wraps) is sharded.

    Example::

        if is_sharded(optimizer):
            consolidate(optimizer)
    """
    return isinstance(getattr(optimizer, "_optimizer", optimizer), ZeroRedundancyOptimizer)


def consolidate(optimizer: torch.optim.Optimizer, to: int = 0) -> None:
    """Gather the sharded state on replica ``to`` of the group: call it on every replica.

    Afterwards ``optimizer.state_dict()`` on that replica is the full state, in the layout of a
    plain optimizer over all the stage's parameters (ids in param-group order). Not sharded: no-op.

    Example::

        consolidate(optimizer)
        full = optimizer.state_dict() if dp_rank == 0 else None
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=to)


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this rank holds (its shard when sharded, by ZeRO or FSDP2).

    Example::

        local_state_bytes(optimizer)   # ~ 1 / replicas of the unsharded AdamW state
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(
        local(v).numel() * v.element_size()  # a DTensor's local shard (FSDP2), not its global size
        for s in inner.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


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


def apply(
    optimizers: list[torch.optim.Optimizer], schedulers: Iterable[Any], group: dist.ProcessGroup | None
) -> list[torch.optim.Optimizer]:
    """Each optimizer as a ZeroRedundancyOptimizer over this stage's replicas ``group`` (right after
    creation); the LR ``schedulers`` follow the new optimizers. One replica: the optimizers unchanged.

    Example::

        optimizers = zero.apply(optimizers, [c.scheduler for c in scheduler_configs], mesh.dp_group)
    """
    schedulers = list(schedulers)
    return [shard_optimizer_state(o, group, schedulers) for o in optimizers]


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


def retarget_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler at ``optimizer``, keeping its "optimizer.step() was called" tracking.

    torch 2.13's ``LRScheduler.__init__`` wraps the optimizer's ``step`` to set ``_opt_called`` and
    tags the wrapper ``_wrapped_by_lr_sched``; without both on the new optimizer the first
    ``scheduler.step()`` warns that ``optimizer.step()`` was overridden. No public hook retargets a
    scheduler, so the same tracking is installed on this one instance (test_zero.py checks it).
    """
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]
