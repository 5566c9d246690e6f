"""The user's optimizer class, stepping on the host: its state there, gradients in and parameters out once
per optimizer step.

:func:`host_stepping` makes the class (named as the user's); :func:`host_step` rebuilds a freshly built
optimizer as it (or ZeRO-1 over it); :func:`use_host_kernels` gives an optimizer already over host tensors
(FSDP2's offloaded shards) the fastest host kernel; :func:`host_kernel` picks that kernel.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.optim.settings import accepted_settings
from lightning_parallel.optim.sharded import is_sharded, retarget_scheduler, shard_optimizer_state

HOST = torch.device("cpu")

# Tried in this order, the first a probe step accepts. Measured (experiments/bench_offload.py, one CPU
# thread, 0.87M parameters in 54 tensors; experiments/results/offload_kernels.csv): AdamW's fused step
# 3.6 ms, foreach 16.8 ms, the loop 34.6 ms; SGD with momentum 2.5 / 5.4 / 6.1 ms.
HOST_KERNELS: tuple[dict[str, bool], ...] = ({"fused": True}, {"foreach": True}, {})
_KERNEL_KEYS = ("fused", "foreach", "capturable")  # the host's own choice, never the user's groups'


def host_kernel(
    cls: type, defaults: dict[str, Any], dtype: torch.dtype = torch.float32, like: DTensor | None = None
) -> dict[str, Any]:
    """The fastest implementation of ``cls``'s step that runs on the host: fused, foreach, or the loop.

    Each candidate is tried on a two-element host tensor (a probe step), a DTensor on ``like``'s mesh
    and placements when the parameters are DTensors (FSDP2's offloaded shards: torch 2.13 has no
    sharding rule for some fused kernels, SGD's among them); ``capturable`` is off (no CUDA graph on
    the host).

    Raises:
        ValueError: no candidate steps a host tensor (a CUDA-only optimizer, or one whose step needs the
            closure, such as LBFGS), with the fix.

    Example::

        >>> host_kernel(torch.optim.AdamW, {"lr": 0.1})
        {'fused': True, 'foreach': False, 'capturable': False}
    """
    accepted = inspect.signature(cls).parameters
    error: Exception | None = None
    for candidate in HOST_KERNELS:
        if any(k not in accepted for k in candidate):
            continue
        kernel = {k: v for k, v in {"fused": False, "foreach": False, **candidate}.items() if k in accepted}
        kernel.update({"capturable": False} if "capturable" in accepted else {})
        try:
            _probe(cls, {**defaults, **kernel}, dtype, like)
            return kernel
        except Exception as err:  # any failure of the probe: try the next kernel
            error = err
    raise ValueError(
        f"offload='optimizer' runs {cls.__name__}'s step on the host, but it failed on a host tensor "
        f"({type(error).__name__}: {error}): use an optimizer whose step runs on the CPU without a closure "
        f"(torch.optim's AdamW, Adam, SGD, ...; not LBFGS, which re-evaluates the loss in its step, nor a "
        f"CUDA-only one), or drop 'optimizer' from offload"
    )


def _probe(cls: type, kwargs: dict[str, Any], dtype: torch.dtype, like: DTensor | None = None) -> None:
    param = torch.zeros(2, dtype=dtype, device=HOST)
    if like is not None:  # (elementwise: no collective, the same answer on every rank)
        param = DTensor.from_local(param, like.device_mesh, like.placements, run_check=False)
    param.requires_grad_(True)
    param.grad = torch.zeros_like(param)
    cls([param], **kwargs).step()


# ------------------------------------------------------------------------- the host-stepping optimizer
@dataclass
class _HostCopy:
    """One trainable parameter's host side: its value (what the host step updates) and a gradient buffer."""

    device: torch.Tensor  # the user's parameter
    host: torch.Tensor
    grad: torch.Tensor
    seen: tuple[int, int] = (-1, 0)  # the device parameter's (version, address) when the two last agreed

    @classmethod
    def of(cls, param: torch.Tensor, pin_memory: bool) -> _HostCopy:
        host = torch.empty_like(param, device=HOST, pin_memory=pin_memory).requires_grad_(True)
        copy = cls(param, host, torch.empty_like(param, device=HOST, pin_memory=pin_memory))
        copy.refresh(force=True)
        return copy

    def refresh(self, force: bool = False) -> None:
        """Take the device value again if something wrote it since (a checkpoint loaded, a broadcast)."""
        now = (self.device._version, self.device.data_ptr())
        if force or now != self.seen:
            self.host.detach().copy_(self.device.detach())
            self.seen = now

    def gradient_in(self, non_blocking: bool) -> None:
        if self.device.grad is None:
            self.host.grad = None
            return
        self.grad.copy_(self.device.grad, non_blocking=non_blocking)
        self.host.grad = self.grad

    def parameter_out(self, non_blocking: bool) -> None:
        self.device.detach().copy_(self.host.detach(), non_blocking=non_blocking)
        self.seen = (self.device._version, self.device.data_ptr())


class _HostState(defaultdict):
    """The user-facing ``optimizer.state``, keyed by the device parameters: whatever is put in it (a
    checkpoint's state loaded by ZeRO-1, by hand) is moved to the host as it arrives."""

    def __init__(self) -> None:
        super().__init__(dict)

    def __setitem__(self, param: Any, value: Any) -> None:
        if isinstance(value, dict):
            value = {k: v.to(HOST) if torch.is_tensor(v) else v for k, v in value.items()}
        super().__setitem__(param, value)

    def link(self, param: Any, value: dict) -> None:
        """The host step's own per-parameter state, shared (already on the host)."""
        dict.__setitem__(self, param, value)


class HostStepping:
    """The user's optimizer class, stepping on the host: mixed in first by :func:`host_stepping`.

    ``param_groups`` are the user's (device parameters and hyper-parameters, which Lightning, the LR
    schedulers, clipping and the GradScaler read and write); ``_host`` is an optimizer of the user's
    class over host copies of the trainable parameters (frozen ones get none: no copy, no state), its
    groups laid out as the user's, so its state dict has the user's ids. ``step`` copies the
    hyper-parameters and the gradients to the host, steps there with the fastest host kernel
    (:func:`host_kernel`), and copies the parameters back: once each per optimizer step.
    """

    _user_class: type
    _pin_memory: bool = False
    home_device = HOST  # its state lives on the host (optim/home.py: where a loaded state goes)

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._user_class.__init__(self, params, *args, **kwargs)
        # The GradScaler unscales the device gradients before step (where the ranks agree on overflow).
        self._step_supports_amp_scaling = False
        defaults = accepted_settings(self._user_class, self.defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self._kernel = host_kernel(
            self._user_class, defaults, first.dtype if first is not None else torch.float32
        )
        self._copies: list[list[_HostCopy | None]] = [self._copies_of(g) for g in self.param_groups]
        groups = [self._host_group(g, c) for g, c in zip(self.param_groups, self._copies)]
        self._host = self._user_class(groups, **{**defaults, **self._kernel})
        self.state = _HostState()
        # Seconds spent so far in each part of step (after the closure): for benchmarks. The parameters'
        # copy back is asynchronous from pinned memory: its time is the enqueueing, not the transfer.
        self.seconds = {"gradients_in": 0.0, "host_step": 0.0, "parameters_out": 0.0}

    def _copies_of(self, group: dict[str, Any]) -> list[_HostCopy | None]:
        return [_HostCopy.of(p, self._pin_memory) if p.requires_grad else None for p in group["params"]]

    def _host_group(self, group: dict[str, Any], copies: list[_HostCopy | None]) -> dict[str, Any]:
        # A frozen parameter stands for itself (never stepped: it has no gradient) so the ids line up.
        params = [c.host if c is not None else p for c, p in zip(copies, group["params"])]
        return {**{k: v for k, v in group.items() if k != "params"}, **self._kernel, "params": params}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._user_class.add_param_group(self, param_group)
        if "_host" in self.__dict__:  # (a group added after construction: BackboneFinetuning's)
            copies = self._copies_of(self.param_groups[-1])
            self._copies.append(copies)
            self._host.add_param_group(self._host_group(self.param_groups[-1], copies))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning's: backward, then clipping and unscaling on the device
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        self._adopt_unfrozen()
        self._sync_groups()
        copies = [c for group in self._copies for c in group if c is not None]
        for copy in copies:
            copy.refresh()
            copy.gradient_in(self._pin_memory)
        if self._pin_memory:  # the host step reads what the device stream is still writing
            torch.accelerator.synchronize()
        copied = time.perf_counter()
        self._host.step()
        stepped = time.perf_counter()
        for copy in copies:
            copy.parameter_out(self._pin_memory)
        self._link_state()
        done = time.perf_counter()
        for key, seconds in zip(self.seconds, (copied - start, stepped - copied, done - stepped)):
            self.seconds[key] += seconds
        return loss

    def _adopt_unfrozen(self) -> None:
        """A parameter frozen at construction that has a gradient now (unfrozen later) gets its copy."""
        for g, (group, copies) in enumerate(zip(self.param_groups, self._copies)):
            for i, (param, copy) in enumerate(zip(group["params"], copies)):
                if copy is None and param.grad is not None:
                    copies[i] = _HostCopy.of(param, self._pin_memory)
                    self._host.param_groups[g]["params"][i] = copies[i].host

    def _sync_groups(self) -> None:
        """The user's hyper-parameters (an LR scheduler's lr, a loaded checkpoint's) reach the host step;
        the implementation stays the host's own."""
        for mine, host in zip(self.param_groups, self._host.param_groups):
            for key, value in mine.items():
                if key != "params" and key not in _KERNEL_KEYS:
                    host[key] = value.to(HOST) if torch.is_tensor(value) else value
            host.update(self._kernel)
        for group, host in zip(self.param_groups, self._host.param_groups):
            for param, entry in zip(group["params"], host["params"]):
                state = self.state.get(param)
                if state is not None and self._host.state.get(entry) is not state:
                    self._host.state[entry] = state  # loaded or set from outside: the host step takes it

    def _link_state(self) -> None:
        for group, host in zip(self.param_groups, self._host.param_groups):
            for param, entry in zip(group["params"], host["params"]):
                if entry in self._host.state:
                    self.state.link(param, self._host.state[entry])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the host step (the state lands on the host directly, never on the device)."""
        self._host.load_state_dict(state_dict)
        for mine, host in zip(self.param_groups, self._host.param_groups):
            mine.update({k: v for k, v in host.items() if k != "params"})
        self.state = _HostState()
        self._link_state()

    def host_bytes(self) -> dict[str, int]:
        """Bytes on the host: the parameter copies with their gradient buffers, and the optimizer state."""
        copies = [c for group in self._copies for c in group if c is not None]
        state = sum(v.nbytes for s in self._host.state.values() for v in s.values() if torch.is_tensor(v))
        return {"copies": sum(c.host.nbytes + c.grad.nbytes for c in copies), "state": state}


@functools.cache
def host_stepping(cls: type, pin_memory: bool = False) -> type:
    """``cls`` made host-stepping (:class:`HostStepping`), named as ``cls``: checkpoints record the user's
    optimizer type, and ``isinstance(optimizer, cls)`` holds.

    Example::

        HostAdamW = host_stepping(torch.optim.AdamW)
        optimizer = HostAdamW(model.parameters(), lr=1e-3)    # state and step on the host
        ZeroRedundancyOptimizer(model.parameters(), optimizer_class=HostAdamW, lr=1e-3)
    """
    if issubclass(cls, HostStepping):
        return cls
    attributes = {
        "_user_class": cls,
        "_pin_memory": pin_memory,
        "__module__": __name__,
        "__qualname__": cls.__qualname__,
    }
    return type(cls.__name__, (HostStepping, cls), attributes)


def is_host_stepping(optimizer: Any) -> bool:
    """Whether ``optimizer`` (inside a LightningOptimizer or ZeRO-1) steps on the host.

    Example::

        is_host_stepping(trainer.optimizers[0])
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return isinstance(getattr(optimizer, "optim", optimizer), HostStepping)


def host_step(optimizer: torch.optim.Optimizer, group: Any, shard: bool, pin_memory: bool,
              schedulers: Iterable[Any] = ()) -> torch.optim.Optimizer:  # fmt: skip
    """``optimizer`` rebuilt as its class made host-stepping over the same groups and defaults (``shard``:
    ZeRO-1 over ``group``, each replica stepping its shard on the host); ``schedulers`` follow it.

    Raises:
        ValueError: it has stepped already (its state would be lost), or its class has no host step.
        TypeError: it is no ``torch.optim.Optimizer``.
    """
    if is_host_stepping(optimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or is_sharded(optimizer):
        raise TypeError(
            f"offload='optimizer' rebuilds the optimizer configure_optimizers returns on the host, but got a "
            f"{type(optimizer).__name__}: return a torch.optim.Optimizer (PipelineStrategy shards it itself "
            f"with data_parallel='zero1')"
        )
    if any(optimizer.state.values()):
        raise ValueError(
            f"offload='optimizer' got a {type(optimizer).__name__} that already holds state: offload it "
            f"right after it is built, before its first step"
        )
    if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "offload='optimizer' keeps host copies of whole tensors, but this optimizer holds DTensor "
            "parameters (split by a parallelize_fn): not supported yet. Use data_parallel='fsdp' with "
            "offload='parameters' (FSDP2 offloads its own shards), or drop offload"
        )
    cls = host_stepping(type(optimizer), pin_memory)
    if shard:
        sharded = shard_optimizer_state(optimizer, group, schedulers, optimizer_class=cls)
        if sharded is not optimizer:
            return sharded
    defaults = accepted_settings(type(optimizer), optimizer.defaults)
    rebuilt = cls([dict(g) for g in optimizer.param_groups], **defaults)
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            retarget_scheduler(scheduler, rebuilt)
    return rebuilt


def use_host_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Run ``optimizer``'s step (already over host tensors: FSDP2's offloaded shards) with the fastest
    host kernel, chosen for its step only: its param groups, hence its state dict, stay as built.

    Example::

        use_host_kernels(torch.optim.AdamW(fsdp_stage.parameters()))   # the fused CPU AdamW
    """
    defaults = accepted_settings(type(optimizer), optimizer.defaults)
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    like = first if isinstance(first, DTensor) else None
    kernel = host_kernel(type(optimizer), defaults, first.dtype if first is not None else torch.float32, like)
    built: list[dict[str, Any]] = []

    def before(opt: Any, args: Any, kwargs: Any) -> None:
        built[:] = [{k: g[k] for k in kernel if k in g} for g in opt.param_groups]
        for g in opt.param_groups:
            g.update(kernel)

    def after(opt: Any, args: Any, kwargs: Any) -> None:
        for g, saved in zip(opt.param_groups, built):
            g.update(saved)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    optimizer.home_device = HOST  # type: ignore[attr-defined]  # (its state is over the host shards)
