"""One Lightning step through the pipeline: training, evaluation (validation, test) and prediction, each
one function read top to bottom.

The user's step runs unchanged: on the first stage up to its pipelined call (to capture that call's
input), on the last stage around the pipeline's output (once per micro-batch in training, as the
schedule's loss function; once per batch in evaluation and prediction). What it logs and returns is
sent from the last stage to every stage of the replica and logged there through ``self.log``; so is an
error it raises there, so that every rank stops with it instead of waiting for the last stage.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lightning_parallel.distributed.agree import packed_error, unpacked_error
from lightning_parallel.pipeline.microbatches import StepMicrobatches
from lightning_parallel.pipeline.state import to_cpu
from lightning_parallel.pipeline.step_logs import LogRecorder, from_record, to_record, weighted_mean
from lightning_parallel.strategies.pipeline.earlier_gradients import (
    earlier_gradients,
    ends_optimizer_step,
    hooks_write_gradients,
)
from lightning_parallel.strategies.pipeline.precision import scaled_loss
from lightning_parallel.strategies.pipeline.step_results import (
    collect_predictions,
    from_last_stage,
    last_pp_rank,
    log_channel,
    numbers_from_last_stage,
    replay_logs,
)
from lightning_parallel.techniques import predictions as technique_predictions
from lightning_parallel.techniques.fsdp.sharding import reshard
from lightning_parallel.timeline.recorder import Timeline, span_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_parallel.pipeline.metrics import BatchWindow
    from lightning_parallel.strategies.pipeline.build import PipelineParts
    from lightning_parallel.strategies.pipeline.step_state import StepState


def run_step(
    parts: PipelineParts,
    state: StepState,
    module: pl.LightningModule,
    step_name: str,
    args: tuple,
    train: bool,
) -> Any:
    """Run ``step_name`` (``training_step``, ...) for one batch through the pipeline: what the user's step
    returns to Lightning (the loss in training, the predictions in prediction, None in evaluation)."""
    if train:
        return training_step(parts, state, module, args)
    if step_name == "predict_step":
        return prediction_step(parts, state, module, args)
    return evaluation_step(parts, state, module, step_name, args)


def training_step(
    parts: PipelineParts, state: StepState, module: pl.LightningModule, args: tuple
) -> torch.Tensor:
    """One training batch: the schedule runs the forward and backward of every micro-batch, with the
    user's step as each one's loss function on the last stage (the gradients held aside for Lightning's
    backward); then the last stage's loss and logs, or its error, reach every stage of the replica."""
    step = _Step(parts, module, "training_step", args, train=True)
    window = step.batch_window()
    with window.collecting() if window is not None else nullcontext():
        loss = step.train(state)
    record, error = step.record_on_last_stage(window, loss)
    (loss_everywhere,), logs = _to_every_stage(parts, state, "training_step", record, error, leading=1)
    replay_logs(module, logs, parts.mesh.group("logs"), parts.metrics)
    return torch.tensor(loss_everywhere, device=module.device)


def evaluation_step(
    parts: PipelineParts, state: StepState, module: pl.LightningModule, step_name: str, args: tuple
) -> None:
    """One validation or test batch: forward through the pipeline, then the user's step on the last stage
    around the output; its logs, or its error, reach every stage of the replica."""
    step = _Step(parts, module, step_name, args, train=False)
    step.evaluate()
    record, error = step.record_on_last_stage(None)
    _, logs = _to_every_stage(parts, state, step_name, record, error, leading=0)
    replay_logs(module, logs, parts.mesh.group("logs"), parts.metrics)


def prediction_step(parts: PipelineParts, state: StepState, module: pl.LightningModule, args: tuple) -> Any:
    """One prediction batch: forward, the user's step on the last stage; its output and logs (any Python
    objects), or its error, reach every stage of the replica; global rank 0 collects every replica's."""
    step = _Step(parts, module, "predict_step", args, train=False)
    output = step.evaluate()
    result = step.prediction_record(output) if parts.runner.has_last else {}
    result = from_last_stage(result, parts.mesh, last_pp_rank(parts))
    if "error" in result:
        raise step.failure if step.failure is not None else unpacked_error(result["error"])
    replay_logs(module, result["logs"], parts.mesh.group("logs"))
    output = result.get("output")
    output = technique_predictions(output, args[0], parts.mesh)  # (sequence parallelism: shards joined)
    if parts.mesh.size("predictions") > 1:
        return collect_predictions(parts, state, output, batch_idx=args[1])
    return output


def _to_every_stage(
    parts: PipelineParts, state: StepState, step_name: str, record: tuple | None, error: Exception | None,
    leading: int,
) -> tuple[list[float], list]:  # fmt: skip
    """The last stage's ``leading`` numbers (the loss) and logs on every stage of the replica, or its
    error raised on every one: one small tensor broadcast."""
    with span_of(state.observer, "log broadcast", "collective"):
        numbers = numbers_from_last_stage(parts, state, step_name, record, error)
    return from_record(*numbers, leading=leading)


class _LossInputs(NamedTuple):
    """What the schedule's loss function reads for micro-batch ``i`` (on the ranks that read it)."""

    chunks: list[Any]  # the batch's micro-batches, as the user's step gets them
    sizes: list[int]  # their samples
    weights: list[float]  # what each micro-batch's loss is multiplied by before backward
    counts: list[float]  # what each one counts (its samples, or its items)


class _Step:
    """One batch of one step method on this rank: its micro-batches and the pipelined call's captured input,
    then training (:meth:`train`) or evaluation (:meth:`evaluate`)."""

    def __init__(
        self, parts: PipelineParts, module: pl.LightningModule, step_name: str, args: tuple, train: bool
    ) -> None:
        self.parts, self.runner, self.call, self.module = parts, parts.runner, parts.call, module
        self.step_name, self.args = step_name, args
        # The batch size and its micro-batches, decided once for everything this step does.
        self.mb = StepMicrobatches.of(args[0], self.runner.num_microbatches)
        self.n, self.m = self.mb.size, self.mb.count
        self.key = shape_key(args[0])
        self.recorder = LogRecorder(parts.metrics.paths if parts.metrics is not None else None)
        self.failure: Exception | None = None  # the user's step raised it on the last stage
        self.step = self._in_scope(getattr(module, step_name))
        self.call.train = train  # the traced path's stand-in keeps one way of calling per mode
        self.items = parts.items if step_name != "predict_step" else None
        self.stage_args = self._captured_input(train)

    def _captured_input(self, train: bool) -> tuple[Any, ...] | None:
        """The pipelined call's input, captured by running the user's step up to it, where it is needed:
        on the first stage, or on every rank whose items are read from the call's labels (every rank in
        training, the last stage in evaluation, to weight the micro-batches' mean losses it merges)."""
        from_call = self.items is not None and self.items.from_call and (train or self.runner.has_last)
        if self.runner.needs_input(self.key, self.m, train) or from_call:
            return self.call.capture(self.step, *self.args)
        return None

    # ------------------------------------------------------------------------------- training
    def train(self, state: StepState) -> float | None:
        """The schedule over the batch's micro-batches; the batch's loss on the last stage, else None."""
        inputs = self._loss_inputs()
        losses: list[torch.Tensor] = []
        loss_fn = self._loss_function(inputs, losses, state.observer)
        batch_idx = self.args[1] if len(self.args) > 1 else None
        earlier = earlier_gradients(self.module.trainer, self.module, batch_idx)
        if not self.runner.has_last and self.parts.mesh.pp_size > 1:
            # The last stage's loss and logs come back after the schedule: the receive waits from now.
            log_channel(self.parts, state, self.step_name).post()
        self._run_schedule(loss_fn, earlier, state)
        if not self.runner.has_last:
            return None
        return weighted_mean([float(v) for v in torch.stack(losses).float().tolist()], inputs.counts)

    def _loss_inputs(self) -> _LossInputs:
        """The micro-batches and their loss weights: on the last stage, and on every rank that counts
        items (counting them is every rank's collective)."""
        if not (self.runner.has_last or self.items is not None):
            return _LossInputs([], [], [], [])
        chunks, sizes = self.mb.batch_chunks(), self.mb.sizes
        weights, counts = self._loss_weights(chunks, sizes)
        return _LossInputs(chunks, sizes, weights, counts)

    def _loss_function(self, inputs: _LossInputs, losses: list, timeline: Timeline | None) -> Any:
        """The schedule's loss function: the user's step around micro-batch ``index``'s output."""
        plugin, rest = self.module.trainer.precision_plugin, self.args[1:]

        def loss_fn(output: Any, index: int) -> torch.Tensor:
            with span_of(timeline, "loss_fn", "loss", mb=index):
                recording = self.recorder.recording(self.module, inputs.sizes[index], inputs.counts[index])
                with self.call.replaying(output), recording:
                    loss = loss_of(self.step(inputs.chunks[index], *rest), self.step_name)
                losses.append(loss.detach())
                # Scale the loss, not the gradients: each micro-batch carries its share of the step's
                # mean (and, under fp16, the GradScaler's scale).
                return scaled_loss(plugin, loss * inputs.weights[index])

        return loss_fn

    def _run_schedule(self, loss_fn: Any, earlier: str, state: StepState) -> None:
        """Forward and backward of every micro-batch; this batch's gradients held aside (``earlier``: what
        happens to those already there) for Lightning's backward; timed while a timeline records."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        timeline = state.observer
        # A window's last batch whose backward leaves the window's gradients in .grad: reductions may
        # start during it (not where they are kept aside and added to earlier ones afterwards).
        state.phase.microbatches = self.m
        trainer = self.module.trainer
        state.phase.reduces = (
            earlier != "keep"
            and ends_optimizer_step(trainer)
            and not hooks_write_gradients(trainer, self.module)
        )
        try:
            with (
                state.held.collecting(params, earlier),
                timeline.torch_schedule() if timeline else nullcontext(),
            ):
                self.runner.train_step(self.key, self.m, self.stage_args, loss_fn)
        finally:
            state.phase.reduces = False

    def _loss_weights(self, chunks: list[Any], sizes: list[int]) -> tuple[list[float], list[float]]:
        """What each micro-batch's loss is multiplied by before backward, and what it counts (its items).

        Sample-weighted: each micro-batch carries its share of the batch and of the accumulation window
        (``n_i / n / accumulate_grad_batches``, as Lightning divides a batch's loss). Item-weighted: its
        items over the window's reference count; the optimizer step scales the gradients to the token
        mean of every batch of the step over every replica (:class:`ItemWindow`).
        """
        samples = [float(n_i) for n_i in sizes]
        counts = self._item_counts(chunks)
        if counts is None:
            scale = 1.0 / self.module.trainer.accumulate_grad_batches
            return [n_i / self.n * scale for n_i in samples], samples
        reference = self.items.window.add_batch(sum(counts), self.parts.mesh.group("tokens"))
        return [c / reference for c in counts], counts

    def _item_counts(self, chunks: list[Any]) -> list[float] | None:
        """Each micro-batch's items, or None when this step does not count items."""
        if self.items is None:
            return None
        return self.items.per_microbatch(chunks, self.stage_args, self.call)

    def batch_window(self) -> BatchWindow | None:
        """Where the user's step runs once per micro-batch (training, on the last stage): the window that
        gives each Metric its step value over the whole batch, not over its last micro-batch."""
        if self.m > 1 and self.runner.has_last and self.parts.metrics is not None:
            return self.parts.metrics.window()
        return None

    # ----------------------------------------------------------------------------- evaluation
    def evaluate(self) -> Any:
        """Forward through the pipeline (the micro-batches' outputs merged into the batch's), then the
        user's step around the output on the last stage; what it returns there (on the host, in
        prediction; None in evaluation), None elsewhere."""
        output = self.runner.forward(self.key, self.m, self.stage_args, self._merge_weights())
        reshard(self.parts.sharded)  # FSDP2 stages keep their gathered weights after forward-only steps
        if not self.runner.has_last:
            return None
        with self.call.replaying(output), self.recorder.recording(self.module, self.n):
            out = self.step(*self.args)
        return to_cpu(out) if self.step_name == "predict_step" else None

    def _merge_weights(self) -> list[float] | None:
        """A mean loss the model returns per micro-batch (``labels=``) merges weighted by their items."""
        if self.items is None or not self.runner.has_last:
            return None
        return self._item_counts(self.mb.batch_chunks())

    # --------------------------------------------------------------- what the last stage sends
    def record_on_last_stage(self, window: BatchWindow | None, *leading: float | None) -> tuple:
        """On the last stage: the step's numbers (``leading``: the loss) and logs as one record, or the
        error the user's step (or its logging) raised; ``(None, None)`` elsewhere."""
        record, error = None, self.failure
        if self.runner.has_last and error is None:
            try:
                if window is not None:
                    window.finish()  # each Metric's step value: over the whole batch
                record = to_record(self.recorder.entries(), *leading)
            except Exception as err:
                error = err
        return record, error

    def prediction_record(self, output: Any) -> dict[str, Any]:
        """On the last stage: the predictions and the logs as objects, or the user's step's error."""
        if self.failure is not None:
            return {"error": packed_error(self.failure)}
        logs = [(e.name, e.combined(), e.replay_kwargs()) for e in self.recorder.entries()]
        return {"output": output, "logs": logs}

    # ------------------------------------------------------------------------ the user's step
    def _in_scope(self, step: Any) -> Any:
        """The user's step, marked as step code while it runs; an error it raises in replay is kept.

        Kept, not raised: in training the schedule must still run every micro-batch on every stage (the
        step is then skipped and the loss is a zero of the stage's output), and the step functions send
        the error to the other stages in the place of the logged values. Errors in capture (the first
        stage, up to the pipelined call) are raised as they come.
        """

        def run(*args: Any) -> Any:
            capturing = self.call.mode == "capture"
            if self.failure is not None and not capturing:
                return self._in_place_of_step()
            with self.parts.scope.running("capture" if capturing else "replay"):
                if capturing:
                    return step(*args)
                try:
                    return step(*args)
                except Exception as err:
                    self.failure = err
            return self._in_place_of_step()

        return run

    def _in_place_of_step(self) -> Any:
        """What a failed step returns: nothing in evaluation; in training a zero loss tied to the output."""
        if not self.call.train:
            return None
        output = torch.utils._pytree.tree_leaves(self.call.replayed)
        leaves = [t for t in output if torch.is_tensor(t) and t.requires_grad]
        if not leaves:
            return torch.zeros((), device=self.module.device)
        total = leaves[0].sum() * 0.0
        for t in leaves[1:]:
            total = total + t.sum() * 0.0
        return total


def shape_key(batch: Any) -> tuple:
    """What decides a schedule's buffers: the shapes and dtypes of the batch's tensors."""
    return tuple(
        (tuple(x.shape), x.dtype) for x in torch.utils._pytree.tree_leaves(batch) if torch.is_tensor(x)
    )


def loss_of(output: Any, step_name: str) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise TypeError(
            f"under PipelineStrategy, {step_name} must return the loss (a scalar tensor, or a dict with "
            f"'loss'); got {type(output).__name__}. Skipping a batch by returning None is not supported"
        )
    return loss
