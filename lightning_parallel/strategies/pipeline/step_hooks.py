"""Lightning's step hooks mapped onto one pipelined step: ``training_step`` ... ``predict_step``,
``backward`` and ``optimizer_step``.

Lightning calls a step, then ``backward``, then the optimizer's step around a closure; the schedule
runs the forward and backward of every micro-batch inside the step itself (:mod:`.step`). So the step
hooks hand the batch to :func:`~lightning_parallel.strategies.pipeline.step.run_step` (sharded first by
the techniques' batch transform, checked first while training), ``backward`` only adds the gradients
the schedule held aside (between Lightning's before/after-backward hooks, which then see them), and the
gradient synchronisation runs once per optimizer step, after the closure and before clipping and the
step, each recorded on the step's timeline when one is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from lightning_parallel.strategies.pipeline.step import run_step
from lightning_parallel.strategies.pipeline.step_results import count_predict_batches
from lightning_parallel.timeline.recorder import Timeline, span_of


class PipelinedSteps:
    """A mixin of ``PipelineStrategy``: its step hooks, ``backward`` and ``optimizer_step``.

    Reads the strategy's ``parts``, ``step_state``, ``precision_plugin``, ``lightning_module``,
    ``_stop_agreement``, ``_batch_transform``, ``_compile_watch`` and ``_sync``, and calls
    ``_check_training_batch`` (``same_data.py``). Example: Lightning's ``training_step`` on every rank
    runs one schedule step over the batch's micro-batches and returns the last stage's loss.
    """

    parts: Any
    step_state: Any
    precision_plugin: Any
    lightning_module: Any
    _stop_agreement: Any
    _batch_transform: Callable[[Any], Any] | None
    _compile_watch: Any
    _sync: Any
    _check_training_batch: Callable[[tuple[Any, ...]], None]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._stop_agreement.at_batch(self.lightning_module.trainer)  # a stop signal to any rank stops all
        with self.precision_plugin.train_step_context():
            return self._pipelined_step("training_step", args, train=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._pipelined_step("validation_step", args, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._pipelined_step("test_step", args, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._pipelined_step("predict_step", args, train=False)

    def _pipelined_step(self, step_name: str, args: tuple[Any, ...], train: bool) -> Any:
        assert self.parts is not None
        if train:
            self._check_training_batch(args)  # the first ones: the same on a replica's ranks, micro-batches
        if self._batch_transform is not None:  # (before anything reads the batch: its micro-batches, items)
            args = (self._batch_transform(args[0]), *args[1:])
        if self._compile_watch is None:
            return run_step(self.parts, self.step_state, self.lightning_module, step_name, args, train)
        with self._compile_watch.reporting(f"this {step_name} (batch {args[1] if len(args) > 1 else '?'})"):
            return run_step(self.parts, self.step_state, self.lightning_module, step_name, args, train)

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        if self.parts is not None:
            count_predict_batches(self.parts, self.step_state, self.lightning_module.trainer)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule already ran backward for every micro-batch inside training_step: add the
        # gradients it held aside, between Lightning's before/after-backward hooks.
        assert self.lightning_module is not None and self.parts is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.step_state.held.add_to_grads()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        assert self.parts is not None and self._sync is not None
        timeline = self.step_state.observer
        synced: list[int] = []

        def closure_then_sync() -> Any:
            result = closure()
            with span_of(timeline, "gradient sync", "collective"):
                self._sync()  # once per optimizer step, before clipping and the step itself
            synced.append(Timeline.now())
            return result

        out = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)  # type: ignore[misc]
        if timeline is not None and synced:  # clipping (a pipeline all-reduce of the norm) and the step
            timeline.add("optimizer step", "optimizer", synced[-1], Timeline.now())
            for name, start, end in self._sync.background_spans():  # (beside the backward: overlapped)
                timeline.add(name, "background", start, end)
        return out
