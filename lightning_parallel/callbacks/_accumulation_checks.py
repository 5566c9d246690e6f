"""What Lightning's GradientAccumulationScheduler refuses, refused with its exception types and messages.

Checked against ``lightning.pytorch.callbacks.GradientAccumulationScheduler`` of Lightning 2.6.6: code
that catches its errors, or matches their text, works with this package's scheduler too. Each message
starts with Lightning's words and goes on with the values and the fix.
"""

from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


class SchedulingError(MisconfigurationException, ValueError):
    """A ``scheduling`` key or value Lightning refuses: its MisconfigurationException, also a ValueError."""


def check_scheduling(scheduling: Mapping[object, object]) -> dict[int, int]:
    """Lightning's checks of ``{epoch: factor}``; returns the schedule in epoch order (as Lightning reads it).

    Example::

        >>> check_scheduling({4: 2, 0: 1})
        {0: 1, 4: 2}
    """
    if not scheduling:
        raise TypeError("Empty dict cannot be interpreted correct: give at least {0: factor}")
    keys, values = list(scheduling), list(scheduling.values())
    if any(not _is_int(k) or k < 0 for k in keys):
        raise SchedulingError(
            f"Epoch should be an int greater than or equal to 0. Got {keys}. Epochs count from 0: "
            "write {4: 2} to accumulate 2 batches from the fifth epoch"
        )
    if any(not _is_int(v) or v < 1 for v in values):
        raise SchedulingError(
            f"Accumulation factor should be an int greater than 0. Got {values}. A factor is the number of "
            "batches per optimizer step: 1 for none"
        )
    return dict(sorted(scheduling.items()))


def check_supported(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Refuse manual optimization, a strategy that accumulates by itself, Trainer(accumulate_grad_batches)."""
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "Automatic gradient accumulation and the `GradientAccumulationScheduler` is not supported for "
            f"manual optimization, and {type(pl_module).__name__} sets `self.automatic_optimization = "
            "False`. Please remove the callback or switch to automatic optimization (or accumulate by "
            "hand in training_step: scale each loss by its samples / the window's samples, step every k "
            "batches)."
        )
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy) or strategy.handles_gradient_accumulation:
        raise RuntimeError(
            f"The `{type(strategy).__name__}` does not support `accumulate_grad_batches` changing between "
            "epochs: it accumulates gradients by itself (handles_gradient_accumulation=True), so the "
            "callback cannot set its windows. Configure accumulation in the strategy instead."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` "
            "callback. Either remove `accumulate_grad_batches` from the Trainer or remove the callback "
            f"(got Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); the callback sets it)."
        )


def warn_if_optimizer_hooks_overridden(pl_module: pl.LightningModule, accumulates: bool) -> None:
    """Lightning's warning: overridden ``optimizer_step``/``optimizer_zero_grad`` run once per window."""
    overridden = is_overridden("optimizer_step", pl_module) or is_overridden("optimizer_zero_grad", pl_module)
    if overridden and accumulates:
        rank_zero_warn(
            "When using `Trainer(accumulate_grad_batches != 1)` and overriding"
            " `LightningModule.optimizer_{step,zero_grad}`, the hooks will not be called on every batch"
            " (rather, they are called on every optimization step)."
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
