"""The pipelined call's input before Lightning's loop runs: ``example_input_array`` or the first batch.

The traced path traces ``forward`` at this input's shape, and ``partition="time"`` times the layers on
it. Reading the first batch at strategy setup needs Lightning's private loader handle (one function,
:func:`first_batch`, checked against Lightning 2.6.6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_parallel.pipeline.proxy import CapturedInput, PipelinedCall
from lightning_parallel.pipeline.step_logs import LogRecorder
from lightning_parallel.traced.call_binding import TracedCall


def example_input(
    trainer: pl.Trainer, module: pl.LightningModule, call: TracedCall, paths: Sequence[str] = ("",)
) -> tuple[Any, ...]:
    """The pipelined call's input to trace at: ``example_input_array``, else captured from the first batch.

    ``paths`` are the modules the step may call to run the model (``""``: ``self(...)``; ``"model"``:
    ``self.model(...)``, a Hugging Face model held by the LightningModule); the first one the step
    calls is the pipelined call from then on.
    """
    call.train = trainer.state.fn == TrainerFn.FITTING
    example = getattr(module, "example_input_array", None)
    if example is not None:
        args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        return call.captured_input(CapturedInput(args))
    for path in paths:
        call.install(module, path)
    try:
        return captured_input(trainer, module, call)
    finally:
        for path in paths:
            call.uninstall(module, path)


def captured_input(trainer: pl.Trainer, module: pl.LightningModule, capture: Any) -> tuple[Any, ...]:
    """Run the step of the trainer's current stage on its first batch up to the pipelined call."""
    step_name = {
        TrainerFn.FITTING: "training_step",
        TrainerFn.VALIDATING: "validation_step",
        TrainerFn.TESTING: "test_step",
        TrainerFn.PREDICTING: "predict_step",
    }[trainer.state.fn]
    batch = trainer.strategy.batch_to_device(first_batch(trainer))
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


class SequentialCapture:
    """Stop the user's step at its call of the Sequential (a forward pre-hook) to read that call's input."""

    def __init__(self, seq: nn.Sequential) -> None:
        self.seq = seq

    def capture(self, step: Any, *args: Any) -> tuple[Any, ...]:
        call = PipelinedCall("the pipelined Sequential")

        def stop(_mod: nn.Module, inputs: tuple[Any, ...]) -> None:
            call(*inputs)  # in capture mode: raises CapturedInput(inputs)

        handle = self.seq.register_forward_pre_hook(stop)
        try:
            return call.capture(step, *args)
        finally:
            handle.remove()
