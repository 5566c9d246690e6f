"""Measure each layer's forward+backward time on an example input (for partition="time")."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn


def layer_times(
    seq: nn.Sequential, args: tuple[Any, ...], device: torch.device, repeats: int = 3
) -> list[float]:
    """Median seconds of forward + backward per layer, each layer fed the previous layer's output.

    Each layer is moved to ``device`` only while it is timed, so the whole model never has to fit there.

    Example::

        costs = layer_times(model.layers, (x,), torch.device("cpu"))
    """
    x: Any = args[0] if len(args) == 1 else args
    x = _to(x, device)
    costs = []
    for layer in seq:
        home = next((p.device for p in layer.parameters()), device)
        layer.to(device)
        samples = []
        for _ in range(repeats + 1):  # the first run warms up
            inp = _detach(x, requires_grad=True)
            _sync(device)
            start = time.perf_counter()
            out = layer(inp)
            floats = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
            if floats:
                torch.autograd.backward([t.sum() for t in floats])
            _sync(device)
            samples.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        layer.to(home)
        costs.append(statistics.median(samples[1:]))
        x = _detach(out, requires_grad=False)
    return costs


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if torch.is_tensor(t)]


def _detach(x: Any, requires_grad: bool) -> Any:
    def one(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        t = t.detach()
        return t.requires_grad_(requires_grad and t.is_floating_point())

    return torch.utils._pytree.tree_map(one, x)


def _to(x: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
