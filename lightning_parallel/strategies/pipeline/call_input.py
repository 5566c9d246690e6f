"""The pipelined call's input before Lightning's loop runs: ``example_input_array`` or the first batch.

The traced path traces ``forward`` at this input's shape, and ``partition="time"`` times the layers on
it. Reading the first batch at strategy setup needs Lightning's private loader handle (one function,
:func:`first_batch`, checked against Lightning 2.6.6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_parallel.pipeline.step_logs import LogRecorder


class TrainerInput:
    """The strategy's :class:`~lightning_parallel.pipeline.stage_source.FirstInput`: what the sources read
    before the loop runs, from the trainer's current stage.

    Example::

        inputs = TrainerInput(trainer, module)
        args = inputs.example() or inputs.capture(call)    # the pipelined call's arguments
    """

    def __init__(
        self, trainer: pl.Trainer, module: pl.LightningModule, transform: Callable[[Any], Any] | None = None
    ) -> None:
        self.trainer, self.module, self.transform = trainer, module, transform
        self.keywords = getattr(transform, "keywords", None)  # (the techniques' InputTransform's)
        self.training = trainer.state.fn == TrainerFn.FITTING

    def example(self) -> tuple[Any, ...] | None:
        example = getattr(self.module, "example_input_array", None)
        if example is None:
            return None
        example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        return self.transform(example) if self.transform is not None else example

    def capture(self, capture: Any) -> tuple[Any, ...]:
        return captured_input(self.trainer, self.module, capture, self.transform)


def captured_input(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    capture: Any,
    transform: Callable[[Any], Any] | None = None,
) -> tuple[Any, ...]:
    """Run the step of the trainer's current stage on its first batch (as the techniques transform every
    batch: ``transform``) up to the pipelined call."""
    step_name = {
        TrainerFn.FITTING: "training_step",
        TrainerFn.VALIDATING: "validation_step",
        TrainerFn.TESTING: "test_step",
        TrainerFn.PREDICTING: "predict_step",
    }[trainer.state.fn]
    batch = trainer.strategy.batch_to_device(first_batch(trainer))
    batch = transform(batch) if transform is not None else batch
    with LogRecorder().recording(module, 1), torch.no_grad():
        return capture.capture(getattr(module, step_name), batch, 0)


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the current stage's dataloader, before Lightning's loop has set it up.

    Lightning 2.6.6 keeps the user's loader in each loop's private ``_data_source``; no public
    accessor exists at strategy setup. test_pipeline_build.py fails loudly if this moves.
    """
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }[trainer.state.fn]
    loader = loop._data_source.dataloader()
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    elif isinstance(loader, dict):
        loader = next(iter(loader.values()))
    return next(iter(loader))
