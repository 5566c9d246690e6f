"""What the schedule inside ``training_step`` may do with the gradients already in ``.grad``.

The pipeline runs backward inside ``training_step``; Lightning zeroes the gradients after
``training_step`` on the first batch of each accumulation window. When Lightning is about to discard
the earlier gradients the schedule releases them first (``"drop"``); inside a window it adds into them
(``"add"``); either way a rank holds one gradient's worth during the schedule, not two. Where a hook
could read the earlier gradients (``on_before_zero_grad``, a custom ``optimizer_zero_grad``) or
Lightning skips backward, they are kept aside and put back (``"keep"``), exactly as before. One
visible difference remains inside a window: ``on_before_backward`` sees this batch's gradients already
added (they are computed inside ``training_step``; ``on_after_backward`` sees the same as before).

Whether this batch's closure zeroes is decided by ``_AutomaticOptimization._make_zero_grad_fn``
(private, Lightning 2.6.6); GradientAccumulationScheduler's step-keyed ramp replaces it per instance,
so asking it gives the windows in force. No public hook answers before ``training_step`` runs;
test_earlier_gradients.py fails loudly if the method goes, and without it the gradients are kept.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden


def earlier_gradients(trainer: pl.Trainer, module: pl.LightningModule, batch_idx: Any) -> str:
    """``"drop"``, ``"add"`` or ``"keep"`` (see :class:`~lightning_parallel.grads.reduce.HeldGradients`)."""
    automatic = trainer.fit_loop.epoch_loop.automatic_optimization
    zero_grad_fn = getattr(automatic, "_make_zero_grad_fn", None)
    if (
        not isinstance(batch_idx, int)
        or not callable(zero_grad_fn)
        or getattr(automatic, "_skip_backward", True)
        or _hooks_read_gradients(trainer, module)
    ):
        return "keep"
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    return "drop" if zero_grad_fn(batch_idx, optimizer) is not None else "add"


def _hooks_read_gradients(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    return (
        is_overridden("on_before_zero_grad", module)
        or is_overridden("optimizer_zero_grad", module)
        or any(is_overridden("on_before_zero_grad", cb, pl.Callback) for cb in trainer.callbacks)
    )


def ends_optimizer_step(trainer: pl.Trainer) -> bool:
    """Whether this training batch's closure steps the optimizer (its gradients are the window's last).

    Lightning 2.6.6 asks ``_FitLoop._should_accumulate`` (private) at the same point, before
    ``training_step``, to decide DDP's ``no_sync`` (a GradientAccumulationScheduler's ramp answers through
    it too). Where it is gone the answer is False: the overlapped reduction then runs after the schedule,
    with the same numbers (test_earlier_gradients.py fails loudly if the method goes).
    """
    should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
    return callable(should_accumulate) and not should_accumulate()


def hooks_write_gradients(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Whether a hook between the schedule and the optimizer step's sync may change the gradients
    (``on_before_backward``, ``on_after_backward``): a reduction started during backward would miss it,
    so the gradients are reduced after them, as without the overlap. A callback whose class says
    ``leaves_gradients_alone = True`` (``HangWatchdog``: its hooks only note where the rank is) does not
    count."""
    names = ("on_before_backward", "on_after_backward")
    return any(is_overridden(n, module) for n in names) or any(
        is_overridden(n, cb, pl.Callback)
        for cb in trainer.callbacks
        if not getattr(cb, "leaves_gradients_alone", False)
        for n in names
    )
