"""Measure each layer's (or block's) forward+backward time on an example input (for partition="time")."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
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


def block_times(
    module: nn.Module, args: tuple[Any, ...], block_paths: Sequence[str], repeats: int = 3
) -> list[float]:
    """Median seconds of forward + backward of each block, timed inside whole-model runs with hooks.

    For modules whose blocks are not a chain of layers one can feed alone (they take a mask, a
    rotary cache...): the model runs as written, where it is, and module hooks time each block's
    forward and backward.

    Example::

        costs = block_times(gpt, (tokens,), [f"h.{i}" for i in range(len(gpt.h))])
    """
    samples: dict[str, list[float]] = {p: [] for p in block_paths}
    started: dict[tuple[str, str], float] = {}
    device = next((p.device for p in module.parameters()), torch.device("cpu"))

    def start(path: str, phase: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            _sync(device)
            started[(path, phase)] = time.perf_counter()

        return hook

    def stop(path: str, phase: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            _sync(device)
            samples[path].append(time.perf_counter() - started.pop((path, phase)))

        return hook

    handles = []
    for path in block_paths:
        block = module.get_submodule(path)
        handles += [
            block.register_forward_pre_hook(start(path, "fwd")),
            block.register_forward_hook(stop(path, "fwd")),
            block.register_full_backward_pre_hook(start(path, "bwd")),
            block.register_full_backward_hook(stop(path, "bwd")),
        ]
    try:
        for _ in range(repeats + 1):  # the first run warms up
            out = module(*args)
            floats = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
            torch.autograd.backward([t.sum() for t in floats])
            module.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    # Each run gives every block a forward then a backward sample; the warm-up run's pair is dropped.
    return [statistics.median(s[i] + s[i + 1] for i in range(2, len(s) - 1, 2)) for s in samples.values()]
