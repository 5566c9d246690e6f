"""Offload's entry points, called by the strategy where what each acts on is made.

* :func:`apply` - the optimizers, right after ``configure_optimizers``. Plain replicas and ZeRO-1: each is
  rebuilt as the user's class made host-stepping (``host_optimizer.py``): it keeps the user's param
  groups (the device parameters, which clipping, loss scaling and LR schedulers read and write) and steps
  a copy of itself over host copies of the trainable parameters; the gradients reach the host once per
  optimizer step, the updated parameters return once. ZeRO-1 builds its shard's optimizer from that
  class. FSDP2 stages (``offload="parameters"``): the user's optimizer holds FSDP2's host shards already;
  its step runs the fastest host kernel.
* :func:`fsdp_policy` - what ``fully_shard`` gets for each stage (FSDP2's ``CPUOffloadPolicy``), or None.
* :func:`apply_activations` - the runner's training steps keep their saved tensors on the host.
* :func:`process_group_backend`, :func:`buffers_to` - the job's host backend beside the device's, and
  a module moved to the device but for its (host) parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.host_optimizer import host_step, use_host_kernels


def describe(offload: Sequence[str], pin_memory: bool) -> str:
    """What is on the host, in words (the log's line).

    Example::

        >>> describe(("optimizer",), False)
        'on the host (not pinned): the optimizer state and its step'
    """
    what = {
        "parameters": "FSDP2's sharded parameters and gradients",
        "optimizer": "the optimizer state and its step",
        "activations": "the activations of the micro-batches in flight",
    }
    shown = [what[t] for t in ("parameters", "optimizer", "activations") if t in offload]
    return f"on the host ({'pinned' if pin_memory else 'not pinned'}): {'; '.join(shown)}"


def pins(offload_pin_memory: bool | None, device: torch.device) -> bool:
    """Whether the host copies are page-locked: as asked, else when the stages run on an accelerator.

    Example::

        >>> pins(None, torch.device("cpu")), pins(None, torch.device("cuda", 0))
        (False, True)
    """
    return device.type != "cpu" if offload_pin_memory is None else offload_pin_memory


def apply(optimizers: Sequence[torch.optim.Optimizer], schedulers: Iterable[Any], plan: Any, group: Any,
          pin_memory: bool) -> list[torch.optim.Optimizer]:  # fmt: skip
    """The optimizers as the plan's offload puts them (right after ``configure_optimizers``): unchanged
    without ``"optimizer"``; FSDP2 stages: their own, stepping with the host kernel; replicas and ZeRO-1
    (``group``: the stage's replicas): rebuilt host-stepping (:func:`host_step`).

    Example::

        optimizers = offload.apply(optimizers, [c.scheduler for c in configs], plan, mesh.dp_group, False)
    """
    if "optimizer" not in plan.offload:
        return list(optimizers)
    if plan.data_parallel == "fsdp":
        for optimizer in optimizers:
            use_host_kernels(optimizer)
        return list(optimizers)
    schedulers = list(schedulers)
    shard = plan.data_parallel == "zero1"
    return [host_step(o, group, shard, pin_memory, schedulers) for o in optimizers]


def fsdp_policy(plan: Any, pin_memory: bool) -> CPUOffloadPolicy | None:
    """FSDP2's offload for each stage (``offload="parameters"``), or None.

    Example::

        fully_shard(block, mesh=mesh, offload_policy=fsdp_policy(plan, False) or OffloadPolicy())
    """
    return CPUOffloadPolicy(pin_memory=pin_memory) if "parameters" in plan.offload else None


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers to ``device``, leaving its parameters where they are (FSDP2's host shards).

    Example::

        buffers_to(stage, torch.device("cuda", 0))   # a BatchNorm's running stats on the GPU
    """
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)


def process_group_backend(device_type: str, given: str | None) -> str | None:
    """The job's backend with a host backend beside the device's: FSDP2's offloaded gradients are host
    tensors, and clipping and the fp16 overflow check reduce them (``"cuda:nccl,cpu:gloo"``, as
    torchtitan does). A CPU job, or a backend that names a host one already, is left as given.

    Example::

        >>> process_group_backend("cuda", None), process_group_backend("cuda", "nccl")
        ('cuda:nccl,cpu:gloo', 'cuda:nccl,cpu:gloo')
        >>> process_group_backend("cpu", None) is None
        True
    """
    if device_type == "cpu" or (given is not None and ("cpu:" in given or given == "gloo")):
        return given
    device_backend = given or {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}.get(device_type, "nccl")
    return f"{device_type}:{device_backend},cpu:gloo"


def apply_activations(runner: Any, pin_memory: bool) -> ActivationOffload:
    """Make ``runner``'s training steps keep their saved activations on the host.

    Example::

        hooks = offload.apply_activations(parts.runner, pin_memory=True)
    """
    runner.saving = ActivationOffload(pin_memory)
    return runner.saving
