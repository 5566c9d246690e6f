"""The Lightning 2.6.6 surfaces GradientAccumulationScheduler has to reach past its public hooks.

Each function changes one thing on one Trainer (or module) object and returns the function that undoes
it; the callback undoes them all at teardown. ``tests/test_accumulation*.py`` fail loudly if a
Lightning internal they rely on moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_parallel.callbacks._step_wrapping import wrap_training_step


def _scale(output: Any, multiplier: float) -> Any:
    if multiplier == 1.0 or output is None:
        return output
    if isinstance(output, Mapping):
        return {**output, "loss": output["loss"] * multiplier}
    return output * multiplier


def _install_loss_multiplier(
    pl_module: pl.LightningModule, multiplier: Callable[[], float]
) -> Callable[[], None]:
    """Wrap ``pl_module.training_step`` on the instance to scale its loss; return the undo function."""
    return wrap_training_step(pl_module, lambda output: _scale(output, multiplier()))


def _override_window_boundaries(
    trainer: pl.Trainer,
    is_window_end: Callable[[int], bool | None],
    is_window_start: Callable[[int], bool | None],
) -> Callable[[], None]:
    """Make Lightning step and zero gradients at our windows' edges; return the undo function.

    Lightning 2.6.6 decides both by modulo of the in-epoch batch index: ``TrainingEpochLoop.
    _accumulated_batches_reached`` (``ready % accumulate_grad_batches == 0``, behind every
    ``_should_accumulate``: DDP no_sync, optimizer step, LR scheduler step, logging) and
    ``_AutomaticOptimization._make_zero_grad_fn`` (``batch_idx % accumulate_grad_batches == 0``). A ramp keyed
    by optimizer step changes the factor mid-epoch, where windows no longer start at multiples of the
    factor, and no public hook can move these decisions. Both are private (checked against 2.6.6):
    test_accumulation.py fails loudly if they go away. Where our window is unknown (a restart before the
    first batch), Lightning's own rule answers.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for owner, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
        if not callable(getattr(type(owner), name, None)):
            raise RuntimeError(
                f"{type(owner).__name__}.{name} is gone from this Lightning version ({pl.__version__}); "
                "GradientAccumulationScheduler's step-keyed ramp was written against 2.6.6"
            )
    lightning_reached = epoch_loop._accumulated_batches_reached
    lightning_zero_grad_fn = automatic._make_zero_grad_fn

    def accumulated_batches_reached() -> bool:
        answer = is_window_end(epoch_loop.batch_progress.current.ready - 1)
        return lightning_reached() if answer is None else answer

    def make_zero_grad_fn(batch_idx: int, optimizer: torch.optim.Optimizer) -> Callable[[], None] | None:
        answer = is_window_start(batch_idx)
        if answer is None:
            return lightning_zero_grad_fn(batch_idx, optimizer)
        if not answer:
            return None
        factor, trainer.accumulate_grad_batches = trainer.accumulate_grad_batches, 1
        try:  # with a factor of 1 Lightning builds its zero-grad function (hooks included) for any batch
            return lightning_zero_grad_fn(batch_idx, optimizer)
        finally:
            trainer.accumulate_grad_batches = factor

    epoch_loop._accumulated_batches_reached = accumulated_batches_reached
    automatic._make_zero_grad_fn = make_zero_grad_fn

    def restore() -> None:
        vars(epoch_loop).pop("_accumulated_batches_reached", None)
        vars(automatic).pop("_make_zero_grad_fn", None)

    return restore


def _install_stepping_estimate(
    trainer: pl.Trainer, estimate: Callable[[Callable[[], int | float]], int | float]
) -> Callable[[], None]:
    """Make ``trainer.estimated_stepping_batches`` answer ``estimate(lightning_estimate)``; return the undo.

    Lightning 2.6.6 computes the property as ``ceil(batches / accumulate_grad_batches) x max_epochs``
    from the factor set when it is read: inside ``configure_optimizers``, before any training hook of
    a callback, and no single factor gives the step count of a ramp. A property cannot be overridden
    on one object, so this trainer's class becomes, until teardown, a subclass (same name and module,
    so it still pickles as the original) whose property asks ``estimate``, handing it Lightning's
    own computation for the cases that need no factor (``max_epochs=-1``, an endless loader).
    """
    base = type(trainer)

    class _EstimatingTrainer(base):  # type: ignore[misc, valid-type]
        @property
        def estimated_stepping_batches(self) -> int | float:
            return estimate(lambda: base.estimated_stepping_batches.fget(self))

    for attr in ("__name__", "__qualname__", "__module__"):
        setattr(_EstimatingTrainer, attr, getattr(base, attr))
    trainer.__class__ = _EstimatingTrainer

    def restore() -> None:
        if type(trainer) is _EstimatingTrainer:
            trainer.__class__ = base

    return restore


def _set_train_progress_total(trainer: pl.Trainer, total: int) -> None:
    """Show ``total`` as this epoch's batch count in Lightning's progress bars (TQDM or Rich).

    ``ProgressBar.total_train_batches`` counts one batch per optimizer step up to ``max_steps`` when
    ``max_epochs=-1``; with accumulation an epoch runs more. Other progress bars keep their total.
    (Rich's bar: its ``progress`` and ``train_progress_bar_id``, public attributes in Lightning 2.6.6.)
    """
    bar = trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar) and bar.is_enabled:
        # Lightning's default when `rich` is installed (transformers brings it, through typer).
        if bar.progress is not None and bar.train_progress_bar_id is not None:
            bar.progress.update(bar.train_progress_bar_id, total=total)
        return
    if not isinstance(bar, TQDMProgressBar) or not bar.is_enabled:
        return
    try:
        tqdm = bar.train_progress_bar
    except TypeError:  # not created yet
        return
    tqdm.total = total
    tqdm.refresh()
