"""The optimizer of FSDP2 shards on the host, the shards on the device (DeepSpeed's ZeRO-3 with
``offload_optimizer``): the user's class made host-stepping for DTensor parameters.

FSDP2's own offload (``CPUOffloadPolicy``) moves the parameter shards to the host too and copies them up
for every all-gather. Here the shards stay FSDP2's, on the device; only the optimizer leaves it. Once per
optimizer step (after backward, clipping and unscaling, which read the device gradients):

1. each trainable shard's gradient (its DTensor gradient's local tensor) is copied to a host fp32 buffer
   (pinned, non-blocking on an accelerator; one synchronisation before the host step);
2. the user's optimizer class steps host copies of the shards with its fastest host kernel
   (:func:`~lightning_parallel.techniques.offload.host_optimizer.host_kernel`): fp32 copies, the master
   weights of bf16 / fp16 shards;
3. the updated shards are copied up into the DTensors' local tensors (cast on the host first for bf16 /
   fp16 shards, so half the bytes cross the link).

It is :class:`~lightning_parallel.techniques.offload.host_optimizer.HostStepping` (its step, its
hyper-parameter and LR-scheduler handling, its class named as the user's) with shard copies and a state
shown as DTensors: ``optimizer.state[p]`` and ``state_dict()`` give each state tensor as a DTensor placed
as ``p`` whose local tensor is the host one (no copy), so the project's consolidated and distributed
checkpoints read and write it as a plain optimizer's over the same DTensors (same ids, groups and keys).
For bf16 / fp16 shards one key is added per parameter, ``"fp32_param"`` (the host's fp32 master of the
shard), so a resume continues from the master and not from the rounded shard; a state without it (a
plain optimizer's) loads, the master then taken from the shard. A master whose rounding is not the shard
it is loaded with (the weights moved on since it was saved) is dropped the same way.

Integration (issue 54, next phase): ``offload="optimizer"`` with ``data_parallel="fsdp"`` builds it with
:func:`host_step_shards` in place of ``CPUOffloadPolicy``; the state's DTensors have host local tensors,
so the consolidated save's gathers need the host backend beside the device's (``"cuda:nccl,cpu:gloo"``),
as ``offload="parameters"`` already does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_parallel.optim import sharded as zero_sharding
from lightning_parallel.optim.settings import accepted_settings
from lightning_parallel.techniques.offload.host_optimizer import (
    _KERNEL_KEYS,
    HOST,
    HostStepping,
)
from lightning_parallel.techniques.offload.host_shards import host_local, local_view, placed_like, written

MASTER = "fp32_param"  # the state key of a bf16 / fp16 shard's fp32 master weights
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the host steps a parameter of ``dtype`` in: fp32 for bf16 / fp16, else its own.

    Example::

        >>> master_dtype(torch.bfloat16), master_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in _LOW_PRECISION else dtype


@dataclass
class _ShardCopy:
    """One trainable shard's host side: its master (what the host step updates), a gradient buffer, and
    for bf16 / fp16 shards a buffer of the shard's dtype the master is rounded into before it goes up."""

    param: torch.Tensor  # the user's parameter (FSDP2's sharded DTensor)
    host: torch.Tensor
    grad: torch.Tensor
    staging: torch.Tensor | None
    seen: tuple[int, int, int] = (-1, -1, 0)  # ``written(param)`` when the two last agreed

    @property
    def device(self) -> torch.Tensor:
        """The local shard on the device (FSDP2 may swap the tensor: read it each time)."""
        return local_view(self.param)

    @classmethod
    def of(cls, param: torch.Tensor, pin_memory: bool) -> _ShardCopy:
        shard = local_view(param)

        def empty(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shard.shape, dtype=dtype, device=HOST, pin_memory=pin_memory)

        dtype = master_dtype(shard.dtype)
        staging = empty(shard.dtype) if dtype != shard.dtype else None
        copy = cls(param, empty(dtype).requires_grad_(True), empty(dtype), staging)
        copy.refresh(force=True)
        return copy

    def refresh(self, force: bool = False) -> None:
        """Take the shard again if something wrote it since (a checkpoint loaded, a broadcast)."""
        shard, now = self.device, written(self.param)
        if force or now != self.seen:
            self.host.detach().copy_(shard)
            self.seen = now

    def gradient_in(self, non_blocking: bool) -> None:
        if self.param.grad is None:
            self.host.grad = None
            return
        self.grad.copy_(local_view(self.param.grad), non_blocking=non_blocking)
        self.host.grad = self.grad

    def parameter_out(self, non_blocking: bool) -> None:
        shard, source = self.device, self.host.detach()
        if self.staging is not None:
            source = self.staging.copy_(source)
        shard.copy_(source, non_blocking=non_blocking)
        self.seen = written(self.param)

    def take_master(self, master: torch.Tensor) -> bool:
        """Use a loaded fp32 master if it rounds to the shard as it is now; whether it was taken."""
        shard = self.device
        if self.staging is None or not torch.equal(master.to(shard.dtype), shard.to(HOST)):
            return False
        self.host.detach().copy_(master)
        self.seen = written(self.param)
        return True


class _PlacedState(MutableMapping):
    """The user-facing ``optimizer.state``, keyed by the user's (DTensor) parameters: the host step's
    state, each tensor shaped as the local shard shown as a DTensor placed as the parameter (sharing the
    host memory), plus the fp32 master of a bf16 / fp16 shard. What is put in it lands on the host."""

    def __init__(self, owner: ShardHostStepping) -> None:
        self._owner = owner
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (group, index): groups only grow

    def _slots(self) -> Iterator[tuple[torch.Tensor, _ShardCopy | None, torch.Tensor]]:
        owner = self._owner
        for group, copies, host in zip(owner.param_groups, owner._copies, owner._host.param_groups):
            yield from zip(group["params"], copies, host["params"])

    def _slot(self, param: Any) -> tuple[_ShardCopy | None, torch.Tensor]:
        groups = self._owner.param_groups
        if id(param) not in self._where:
            self._where = {
                id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group["params"])
            }
        g, i = self._where.get(id(param), (-1, -1))
        if g < 0 or groups[g]["params"][i] is not param:
            raise KeyError(param)
        return self._owner._copies[g][i], self._owner._host.param_groups[g]["params"][i]

    def __getitem__(self, param: Any) -> dict[str, Any]:
        copy, entry = self._slot(param)
        if entry not in self._owner._host.state:  # (a defaultdict: reading would add an empty state)
            raise KeyError(param)
        state = self._owner._host.state[entry]
        shown = {k: placed_like(v, param) if _per_element(v, entry) else v for k, v in state.items()}
        if copy is not None and copy.staging is not None:
            shown[MASTER] = placed_like(copy.host.detach(), param)
        return shown

    def __setitem__(self, param: Any, value: dict[str, Any]) -> None:
        copy, entry = self._slot(param)
        value = dict(value)
        master = value.pop(MASTER, None)
        dtype = entry.dtype if entry.is_floating_point() else None
        self._owner._host.state[entry] = {k: _state_value(k, v, param, dtype) for k, v in value.items()}
        if master is not None and copy is not None:
            copy.take_master(host_local(master, param, torch.float32))

    def __delitem__(self, param: Any) -> None:
        del self._owner._host.state[self._slot(param)[1]]

    def __iter__(self) -> Iterator[Any]:
        return (p for p, _, entry in self._slots() if entry in self._owner._host.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _per_element(value: Any, entry: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == entry.shape


def _state_value(key: str, value: Any, param: torch.Tensor, dtype: torch.dtype | None) -> Any:
    # Adam's "step" keeps its own dtype (torch's load_state_dict rule); the rest the host step's.
    return host_local(value, param, None if key == "step" else dtype)


class ShardHostStepping(HostStepping):
    """The user's optimizer class, stepping DTensor shards (FSDP2's) on the host: mixed in first by
    :func:`shard_host_stepping`. Plain tensors work too (their "shard" is the whole tensor)."""

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.state = _PlacedState(self)

    def _copies_of(self, group: dict[str, Any]) -> list[_ShardCopy | None]:  # type: ignore[override]
        return [_ShardCopy.of(p, self._pin_memory) if p.requires_grad else None for p in group["params"]]

    def _adopt_unfrozen(self) -> None:
        for g, (group, copies) in enumerate(zip(self.param_groups, self._copies)):
            for i, (param, copy) in enumerate(zip(group["params"], copies)):
                if copy is None and param.grad is not None:
                    copies[i] = _ShardCopy.of(param, self._pin_memory)
                    self._host.param_groups[g]["params"][i] = copies[i].host

    def _sync_groups(self) -> None:
        """The user's hyper-parameters reach the host step (its state is the host's own: nothing to link)."""
        for mine, host in zip(self.param_groups, self._host.param_groups):
            for key, value in mine.items():
                if key != "params" and key not in _KERNEL_KEYS:
                    host[key] = value.to(HOST) if torch.is_tensor(value) else value
            host.update(self._kernel)

    def _link_state(self) -> None:
        pass  # ``state`` is a view of the host step's

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the host step: each DTensor's local part lands on the host, never on the device."""
        params = {
            pid: p
            for saved, group in zip(state_dict["param_groups"], self.param_groups)
            for pid, p in zip(saved["params"], group["params"])
        }
        masters, state = {}, {}
        for pid, values in state_dict["state"].items():
            values = dict(values)
            if (master := values.pop(MASTER, None)) is not None:
                masters[params[pid]] = master
            state[pid] = {k: _state_value(k, v, params[pid], None) for k, v in values.items()}
        super().load_state_dict({**state_dict, "state": state})
        self.state = _PlacedState(self)
        for copy in (c for copies in self._copies for c in copies if c is not None):
            if copy.param in masters:
                copy.take_master(host_local(masters[copy.param], copy.param, torch.float32))

    def host_bytes(self) -> dict[str, int]:
        """Bytes on the host: the masters, gradient and rounding buffers, and the optimizer state."""
        found = super().host_bytes()
        copies = [c for group in self._copies for c in group if c is not None]
        found["copies"] += sum(c.staging.nbytes for c in copies if c.staging is not None)
        return found


@functools.cache
def shard_host_stepping(cls: type, pin_memory: bool = False) -> type:
    """``cls`` made host-stepping for sharded parameters (:class:`ShardHostStepping`), named as ``cls``.

    Example::

        HostAdamW = shard_host_stepping(torch.optim.AdamW)
        optimizer = HostAdamW(fsdp_stage.parameters(), lr=1e-3)   # shards on the device, AdamW on the host
    """
    if issubclass(cls, HostStepping):
        return cls
    attributes = {
        "_user_class": cls,
        "_pin_memory": pin_memory,
        "__module__": __name__,
        "__qualname__": cls.__qualname__,
    }
    return type(cls.__name__, (ShardHostStepping, cls), attributes)


def host_step_shards(
    optimizer: torch.optim.Optimizer, pin_memory: bool, schedulers: Iterable[Any] = ()
) -> torch.optim.Optimizer:
    """``optimizer`` (over FSDP2's sharded parameters, freshly built) rebuilt as its class made
    host-stepping for shards, same groups and defaults; the LR ``schedulers`` that drive it follow.

    Raises:
        TypeError: it is no ``torch.optim.Optimizer`` (or already sharded by ZeRO).
        ValueError: it has stepped already (its state would be lost), or its class has no host step.

    Example::

        fully_shard(model)
        optimizer = host_step_shards(torch.optim.AdamW(model.parameters()), pin_memory=True)
    """
    if isinstance(optimizer, ShardHostStepping):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or zero_sharding.is_sharded(optimizer):
        raise TypeError(
            f"offload='optimizer' rebuilds the optimizer over the FSDP2 shards on the host, but got a "
            f"{type(optimizer).__name__}: return a torch.optim.Optimizer from configure_optimizers"
        )
    if any(optimizer.state.values()):
        raise ValueError(
            f"offload='optimizer' got a {type(optimizer).__name__} that already holds state: offload it "
            f"right after it is built, before its first step"
        )
    cls = shard_host_stepping(type(optimizer), pin_memory)
    defaults = accepted_settings(type(optimizer), optimizer.defaults)
    rebuilt = cls([dict(g) for g in optimizer.param_groups], **defaults)
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            zero_sharding.retarget_scheduler(scheduler, rebuilt)
    return rebuilt
