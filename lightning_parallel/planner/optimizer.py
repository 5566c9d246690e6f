"""Optimizer state bytes per parameter, learnt from the optimizer itself on a tiny stand-in.

Rather than a table of known optimizers, the optimizer's class is built with each param group's
hyper-parameters over one small tensor of the group's dtype and stepped twice; what its state holds
then (tensors the size of the parameter, and fixed-size ones such as Adam's ``step``) sizes the
state of every real parameter. AdamW in fp32: 8 bytes per element + 4 per tensor; SGD with momentum:
4 per element; plain SGD: nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_parallel.optim.settings import accepted_settings

_PROBE_NUMEL = 16


@dataclass(frozen=True)
class StateSize:
    """State of one parameter: ``per_element`` bytes per element plus ``per_tensor`` fixed bytes."""

    per_element: int = 0
    per_tensor: int = 0

    def of(self, numel: int) -> int:
        return self.per_element * numel + self.per_tensor


def optimizers_from(config: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (optimizer, list, dict, tuple).

    Example::

        optimizers_from({"optimizer": opt, "lr_scheduler": sched})   # [opt]
    """
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, dict):
        return optimizers_from(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        if config and isinstance(config[0], (list, tuple)):  # ([optimizers], [schedulers])
            return optimizers_from(config[0])
        return [o for item in config for o in optimizers_from(item)]
    return []


def state_sizes(
    optimizers: Iterable[torch.optim.Optimizer], dtype: torch.dtype | None = None
) -> dict[int, StateSize]:
    """``id(parameter) -> StateSize`` for every parameter the optimizers manage.

    ``dtype``: size the state as if the parameters had this dtype (a ``*-true`` precision).

    Raises:
        ValueError: an optimizer cannot be stepped on a stand-in tensor (the message names it).

    Example::

        sizes = state_sizes([torch.optim.AdamW(model.parameters())])
        sum(sizes[id(p)].of(p.numel()) for p in model.parameters())   # AdamW bytes
    """
    out: dict[int, StateSize] = {}
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        cls = type(optimizer.optim) if isinstance(optimizer, ZeroRedundancyOptimizer) else type(optimizer)
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            by_dtype: dict[torch.dtype, StateSize] = {}
            for p in group["params"]:
                as_dtype = dtype or p.dtype
                if as_dtype not in by_dtype:
                    by_dtype[as_dtype] = _probe(cls, hyper, as_dtype)
                out[id(p)] = by_dtype[as_dtype]
    return out


def _probe(cls: type, hyper: dict[str, Any], dtype: torch.dtype) -> StateSize:
    # CPU stand-in: the default implementation, same state
    kwargs = accepted_settings(cls, hyper, drop=("fused", "foreach", "capturable"))
    param = nn.Parameter(torch.zeros(_PROBE_NUMEL, dtype=dtype))
    try:
        optimizer = cls([param], **kwargs)
        for _ in range(2):
            param.grad = torch.full_like(param, 1e-3)
            optimizer.step()
    except Exception as err:
        raise ValueError(
            f"could not size the state of {cls.__name__} by stepping it on a stand-in tensor "
            f"({type(err).__name__}: {err}); pass optimizer= to estimate_memory with an optimizer that "
            f"can be stepped without a closure, or a state size"
        ) from err
    per_element = per_tensor = 0
    for value in optimizer.state[param].values():
        if torch.is_tensor(value):
            if value.numel() == _PROBE_NUMEL:
                per_element += value.element_size()
            else:
                per_tensor += value.numel() * value.element_size()
    return StateSize(per_element, per_tensor)
