"""Where an optimizer keeps its state: its home device, which the optimizer says itself.

An optimizer built by a technique to step on the host (offload's host-stepping optimizers; one over FSDP2's
offloaded shards) carries ``home_device``, the host; any other keeps its state beside its parameters, on
the job's device. Checkpoint loading puts a loaded state there (``strategies/pipeline/checkpointing.py``)
without asking the plan where it lives. Pure PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["home_device"]


def home_device(optimizer: Any, default: torch.device) -> torch.device:
    """The device ``optimizer`` keeps its state on: the one it names (``home_device``), else ``default``.

    Looks inside a ``LightningOptimizer`` and ZeRO-1's ``ZeroRedundancyOptimizer`` (whose shard's
    optimizer names it).

    Example::

        >>> home_device(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), torch.device("cpu"))
        device(type='cpu')
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(inner, ZeroRedundancyOptimizer):
        inner = inner.optim
    home = getattr(inner, "home_device", None)
    return home if isinstance(home, torch.device) else default
