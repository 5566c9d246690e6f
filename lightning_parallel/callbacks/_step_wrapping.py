"""A callback's change to what ``training_step`` returns, made on the module instance and undone after.

Both the accumulation scheduler (the loss scaled by its window's multiplier) and the token-weighted loss
(the loss's gradient scaled, its value kept) change the user's step's output the same way: a wrapper
set on the instance (the class's method stays), removed at teardown, putting back a wrapper the
instance held before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl


def wrap_training_step(pl_module: pl.LightningModule, change: Callable[[Any], Any]) -> Callable[[], None]:
    """Set ``training_step`` on the instance to return ``change(output)``; returns the undo function.

    Example::

        undo = wrap_training_step(model, lambda out: out * 0.5)   # half the loss from now on
        undo()                                                     # the module's own step again
    """
    own = vars(pl_module)
    had_own, previous = "training_step" in own, own.get("training_step")
    inner = pl_module.training_step

    @functools.wraps(inner)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        return change(inner(*args, **kwargs))

    pl_module.training_step = training_step

    def restore() -> None:
        if had_own:
            pl_module.training_step = previous
        else:
            vars(pl_module).pop("training_step", None)

    return restore
