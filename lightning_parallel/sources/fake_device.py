"""Fake tensors of the device a stage runs on: what the traced path traces, orders and sizes with.

The twin of a module (:func:`~lightning_parallel.sources.traced.trace.meta_twin`) keeps its tensors on the
``meta`` device: they allocate nothing, but a forward that asks its inputs' device (``torch.autocast(
x.device.type, ...)``, ``if x.is_cuda:``, a kernel chosen by device) is told ``meta``, and the graph
traced from it is not the one the device runs. A ``FakeTensor`` allocates nothing either (a meta
tensor inside) but reports the device it was made for, so the forward takes that device's path.
``FakeTensorMode`` takes no device: its factory calls do (``torch.empty(..., device="cuda:0")`` under
the mode is a fake CUDA tensor, also on a build without CUDA).

Autograd cannot record on fake tensors of a device this process has no runtime for (fake CUDA on a
CPU-only build aborts the process, pytorch#122109); there, as torch's own workaround does
(pytorch#113681), the fakes do not require gradients. A job traces where it runs, so this only
concerns tests that trace for a device the machine lacks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map


def trace_device(device: torch.device | str | None) -> torch.device:
    """The device to fake: ``device`` with an index (``"cuda"`` -> ``cuda:0``), the CPU if ``None``.

    A fake tensor on an accelerator without an index asks the runtime for the current device, which
    a build without that runtime cannot answer.

    Example::

        >>> trace_device("cuda")
        device(type='cuda', index=0)
    """
    device = torch.device("cpu" if device is None else device)
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    runtime = getattr(torch, device.type, None)
    available = runtime is not None and getattr(runtime, "is_available", lambda: False)()
    return torch.device(device.type, runtime.current_device() if available else 0)


# torch workaround: https://github.com/pytorch/pytorch/issues/122109
#   canary: test_autograd_records_on_fake_tensors_of_a_device_this_build_lacks
def tracks_gradients(device: torch.device) -> bool:
    """Whether autograd can record on fake tensors of ``device`` in this process (see the module doc)."""
    if device.type in ("cpu", "meta"):
        return True
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator is not None and accelerator.type == device.type


@dataclass
class FakeDevice:
    """A ``FakeTensorMode`` and the device its tensors are made for (see :func:`faked_on`).

    Example::

        with faked_on(twin, torch.device("cuda:0")) as fake:
            with fake.mode:
                logits = twin(*fake.inputs(example))     # logits.device: cuda:0, nothing allocated
    """

    mode: FakeTensorMode
    device: torch.device
    originals: dict[int, torch.Tensor] = field(default_factory=dict)  # id(fake) -> the tensor it stands for

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """An empty fake tensor on the device with ``t``'s shape, strides and dtype (and, where autograd
        can record there, its ``requires_grad``)."""
        with self.mode:
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
        return out.requires_grad_(t.requires_grad and tracks_gradients(self.device))

    def inputs(self, tree: Any) -> Any:
        """``tree`` with every tensor replaced by a fake one on the device (:meth:`like`)."""
        return tree_map(lambda t: self.like(t) if torch.is_tensor(t) else t, tree)

    def original(self, t: Any) -> Any:
        """The tensor a fake one of :func:`faked_on` stands for (``t`` itself if none)."""
        return self.originals.get(id(t), t)


@contextlib.contextmanager
def faked_on(
    module: nn.Module | Sequence[nn.Module], device: torch.device | str | None
) -> Iterator[FakeDevice]:
    """For the duration, ``module``'s parameters and buffers are fake tensors on ``device`` (ties kept).

    ``module`` may be several modules (a pipe's stages), faked in one mode: one's outputs feed another.

    Everything is put back on exit: the tensors, and any tensor attribute the forward rebinds
    (``self.freqs = self.freqs.to(x.device)``), so the module can be faked again for another trace.

    Example::

        with faked_on(meta_twin(model), "cpu") as fake:
            program = torch.export.export(twin, fake.inputs(example))
    """
    fake = FakeDevice(FakeTensorMode(allow_non_fake_inputs=True), trace_device(device))
    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    roots = [module] if isinstance(module, nn.Module) else list(module)
    modules = list(dict.fromkeys(m for root in roots for m in root.modules()))
    attributes = [(m, {k: v for k, v in vars(m).items() if torch.is_tensor(v)}) for m in modules]
    for m in modules:
        for slot in (m._parameters, m._buffers):
            for name, t in slot.items():
                if t is None:
                    continue
                if id(t) not in made:
                    like = fake.like(t)
                    made[id(t)] = (
                        nn.Parameter(like, like.requires_grad) if isinstance(t, nn.Parameter) else like
                    )
                    fake.originals[id(made[id(t)])] = t
                swapped.append((slot, name, t))
                slot[name] = made[id(t)]
    try:
        yield fake
    finally:
        for slot, name, t in swapped:
            slot[name] = t
        for m, tensors in attributes:
            vars(m).update(tensors)
