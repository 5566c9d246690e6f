"""The activations of the micro-batches in flight, on the host: saved-tensor hooks around each step."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

HOST = torch.device("cpu")


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep what backward needs on the host until backward asks for it.

    Entered around each training schedule step, so every micro-batch in flight (1F1B, interleaved, the V
    schedules' split backward, which reads a saved tensor twice) keeps its activations on the host,
    and so do the inputs a recomputed unit keeps (torch's non-reentrant checkpoint saves them through
    these hooks; what it recomputes in backward stays on the device, as it is needed at once).
    Parameters, views of them and a stage's received inputs (leaves that need a gradient) are left
    where they are: they are held anyway. A tensor saved twice (an activation's output, the next layer's
    input) is copied once. Counts what it moved (``packed`` tensors of ``packed_bytes``
    in all, ``live_bytes`` on the host now, ``peak_bytes`` at most) for tests and benchmarks.

    Example::

        hooks = ActivationOffload(pin_memory=True)
        with hooks:
            schedule.step(x, target=y)
        hooks.peak_bytes        # the most bytes held on the host at once
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self.packed = self.packed_bytes = self.live_bytes = self.peak_bytes = 0
        # id(device tensor) -> (a weak reference to it, its version then, a weak reference to its copy)
        self._copies: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        held = isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
        plain = type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_meta
        if held or not plain:
            return tensor
        key, version = id(tensor), tensor._version
        found = self._copies.get(key)
        if found is not None and found[0]() is tensor and found[1] == version and found[2]() is not None:
            return tensor.device, found[2]()
        host = torch.empty_like(tensor, device=HOST, pin_memory=self.pin_memory)
        host.copy_(tensor, non_blocking=self.pin_memory)
        forget = functools.partial(_forget, self._copies, key)
        self._copies[key] = (weakref.ref(tensor, forget), version, weakref.ref(host))
        self.packed += 1
        self.packed_bytes += host.nbytes
        self.live_bytes += host.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host, self._freed, host.nbytes)
        return tensor.device, host

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=self.pin_memory)

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def _forget(copies: dict, key: int, _: Any) -> None:
    copies.pop(key, None)
