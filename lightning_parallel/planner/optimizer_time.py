"""How long the optimizer's step takes, per element and per tensor, timed on stand-ins.

The optimizer step is timed by stepping the optimizer's own class over stand-in tensors of two
shapes (one large tensor, many small ones): seconds per element and per tensor, on the device and,
where the host is another memory, on the host (what an offloaded step costs). The time probe
(:mod:`~lightning_parallel.planner.time_probe`) records both in its ``TimeFacts``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_parallel.optim.settings import accepted_settings
from lightning_parallel.techniques.offload.host_optimizer import host_kernel


@dataclass(frozen=True)
class StepCost:
    """An optimizer step's seconds: ``per_element x elements + per_tensor x tensors``."""

    per_element: float = 0.0
    per_tensor: float = 0.0

    def of(self, elements: float, tensors: float) -> float:
        return self.per_element * elements + self.per_tensor * tensors


def optimizer_step_cost(
    optimizers: list[torch.optim.Optimizer],
    device: torch.device,
    numel: int = 1 << 18,
    repeats: int = 3,
    on_host: bool = False,
) -> StepCost:
    """Seconds per element and per tensor of the optimizers' step, timed on stand-ins on ``device``.

    The first optimizer's class and first param group's settings are stepped over one tensor of
    ``numel`` elements and over 64 tensors of ``numel / 64``: two points, a line. ``on_host``: with the
    kernel an offloaded step runs on the host (the fastest of fused, foreach and the loop,
    ``techniques/offload/host_optimizer.py: host_kernel``).

    Example::

        optimizer_step_cost([torch.optim.AdamW(model.parameters())], torch.device("cpu"))
    """
    if not optimizers:
        return StepCost()
    cls, kwargs = _optimizer_settings(optimizers)
    if on_host:
        kwargs |= host_kernel(cls, kwargs)
    one = _step_seconds(cls, kwargs, [numel], device, repeats)
    many = _step_seconds(cls, kwargs, [numel // 64] * 64, device, repeats)
    per_tensor = max(0.0, (many - one) / 63)
    return StepCost(max(0.0, (one - per_tensor) / numel), per_tensor)


def optimizer_factory(optimizers: list[torch.optim.Optimizer]) -> Callable[[list[Any]], Any] | None:
    """``make(params)``: the first optimizer's class with its first param group's settings, over
    ``params`` (what a technique steps on its own tensors, e.g. FSDP2's DTensor shards); None without one.

    Example::

        make = optimizer_factory([torch.optim.AdamW(model.parameters(), lr=1e-3)])
        make([torch.zeros(4, requires_grad=True)]).step()
    """
    if not optimizers:
        return None
    cls, kwargs = _optimizer_settings(optimizers)
    return lambda params: cls(params, **kwargs)


def _optimizer_settings(optimizers: list[torch.optim.Optimizer]) -> tuple[type, dict[str, Any]]:
    optimizer = getattr(optimizers[0], "_optimizer", optimizers[0])
    optimizer = getattr(optimizer, "optim", optimizer)  # a ZeroRedundancyOptimizer's local one
    cls = type(optimizer)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    return cls, accepted_settings(cls, group, drop=("fused", "capturable"))


def _step_seconds(
    cls: type, kwargs: dict[str, Any], sizes: list[int], device: torch.device, repeats: int
) -> float:
    params = [nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    try:
        optimizer = cls(params, **kwargs)
    except Exception:
        return 0.0  # an optimizer that cannot be built on stand-ins: its step is not charged
    samples = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])
