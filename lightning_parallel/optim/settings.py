"""An optimizer's settings as its class's constructor takes them: what rebuilding it needs.

An optimizer's ``defaults`` and param groups hold keys its constructor does not take (``differentiable``
where a subclass dropped it, a scheduler's ``initial_lr``, a group's ``params``): every place that builds
an optimizer again (sharded, host-stepping, disk-backed, a planner probe) keeps only the accepted ones,
here. Pure Python.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["accepted_settings"]


def accepted_settings(cls: type, settings: Mapping[str, Any], drop: Iterable[str] = ()) -> dict[str, Any]:
    """The entries of ``settings`` that ``cls(params, **settings)`` accepts as keywords, less ``drop``
    (and ``params``, which is never a setting).

    Example::

        >>> import torch
        >>> accepted_settings(torch.optim.SGD, {"lr": 0.1, "initial_lr": 0.1, "params": []})
        {'lr': 0.1}
    """
    accepted = inspect.signature(cls).parameters
    dropped = {"params", *drop}
    return {k: v for k, v in settings.items() if k in accepted and k not in dropped}
