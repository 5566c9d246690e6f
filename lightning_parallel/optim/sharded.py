"""An optimizer's state sharded over the replicas of a stage: torch's ``ZeroRedundancyOptimizer``, built
from a freshly made optimizer (its class, param groups and defaults), its LR schedulers following it.

The mechanic ZeRO-1 (``techniques/zero.py``) and offload's host-stepping ZeRO-1
(``techniques/offload/host_optimizer.py``) both build on, one floor below the techniques. Pure PyTorch.

Checkpoints stay whole: :func:`consolidate` gathers the state on replica 0 (a collective over the
replica group), where ``optimizer.state_dict()`` is then the full, unsharded state in torch's usual
layout. A full state loads with ``optimizer.load_state_dict(full)`` on every replica, each keeping
its share, so a checkpoint moves between any shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_parallel.distributed.dtensors import local
from lightning_parallel.optim.settings import accepted_settings


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
        group: the ranks that share this rank's stage's optimizer state (``mesh.group("optimizer_shard")``).
        schedulers: LR schedulers (``torch.optim.lr_scheduler`` objects) to retarget.
        optimizer_class: the class each replica builds over its shard (default: ``optimizer``'s own;
            offload passes it made host-stepping), taking ``optimizer``'s defaults.

    Raises:
        ValueError: the optimizer has already stepped (its state would be lost), or is a wrapper.

    Example::

        group = mesh.group("optimizer_shard")
        optimizer = shard_optimizer_state(torch.optim.AdamW(stage.parameters()), group, [sched])
        ...
        consolidate(optimizer)             # every replica of the stage
        if mesh.rank("optimizer_shard") == 0:
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
    defaults = accepted_settings(type(optimizer), optimizer.defaults)
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
        full = optimizer.state_dict() if mesh.rank("optimizer_shard") == 0 else None
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
