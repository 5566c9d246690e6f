"""One Lightning step through the pipeline: capture the input, run the schedule, return loss and logs.

The user's step runs unchanged: on the first stage up to its pipelined call (to capture that call's
input), on the last stage around the pipeline's output (once per micro-batch in training, as the
schedule's loss function; once per batch in evaluation). What it logs and returns is sent from the
last stage to every stage of the replica and logged there through ``self.log``; so is an error it
raises there, so that every rank stops with it instead of waiting for the last stage.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from lightning_parallel.distributed.agree import packed_error, unpacked_error
from lightning_parallel.pipeline.microbatches import StepMicrobatches
from lightning_parallel.pipeline.state import to_cpu
from lightning_parallel.pipeline.step_logs import (
    LogRecorder,
    from_record,
    to_record,
    weighted_mean,
)
from lightning_parallel.strategies.pipeline.earlier_gradients import earlier_gradients
from lightning_parallel.strategies.pipeline.precision import scaled_loss
from lightning_parallel.strategies.pipeline.step_results import (
    collect_predictions,
    from_last_stage,
    last_pp_rank,
    log_channel,
    numbers_from_last_stage,
    replay_logs,
)
from lightning_parallel.techniques.fsdp import reshard
from lightning_parallel.timeline.recorder import span_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_parallel.strategies.pipeline.build import PipelineParts
    from lightning_parallel.strategies.pipeline.step_state import StepState


def run_step(
    parts: PipelineParts,
    state: StepState,
    module: pl.LightningModule,
    step_name: str,
    args: tuple[Any, ...],
    train: bool,
) -> Any:
    """Run ``step_name`` (``training_step``, ...) for one batch through the pipeline.

    An error the user's step raises on the last stage (or one in what it logged) travels to every stage
    in the place of the logged values: every rank raises it at the same point.
    """
    mesh = parts.mesh
    step = _Step(parts, module, step_name, args, train)
    split = train and step.m > 1 and parts.runner.has_last  # the step runs once per micro-batch here
    window = parts.metrics.window() if split and parts.metrics is not None else None
    with window.collecting() if window is not None else nullcontext():
        result = step.train(state) if train else step.evaluate()
    if step_name == "predict_step":
        return _predicted(parts, state, module, step, result, args)
    record, error = None, step.failure
    if parts.runner.has_last and error is None:
        try:
            if window is not None:
                window.finish()  # each Metric's step value: over the whole batch, not its last micro-batch
            record = to_record(step.recorder.entries(), *([result["loss"]] if train else []))
        except Exception as err:
            error = err
    with span_of(state.observer, "log broadcast", "collective"):
        numbers = numbers_from_last_stage(parts, state, step_name, record, error)
    leading, logs = from_record(*numbers, leading=int(train))
    replay_logs(module, logs, mesh.group("logs"), parts.metrics)
    return torch.tensor(leading[0], device=module.device) if train else None


def _predicted(
    parts: PipelineParts,
    state: StepState,
    module: pl.LightningModule,
    step: _Step,
    result: dict[str, Any],
    args: tuple,
) -> Any:
    mesh = parts.mesh
    if parts.runner.has_last:
        result["logs"] = [(e.name, e.combined(), e.replay_kwargs()) for e in step.recorder.entries()]
        if step.failure is not None:
            result = {"error": packed_error(step.failure)}
    result = from_last_stage(result, mesh, last_pp_rank(parts))
    if "error" in result:
        raise step.failure if step.failure is not None else unpacked_error(result["error"])
    replay_logs(module, result["logs"], mesh.group("logs"))
    if mesh.size("predictions") > 1:
        return collect_predictions(parts, state, result.get("output"), batch_idx=args[1])
    return result.get("output")


class _Step:
    """One batch of one step method on this rank: the input capture, then training or evaluation."""

    def __init__(
        self,
        parts: PipelineParts,
        module: pl.LightningModule,
        step_name: str,
        args: tuple[Any, ...],
        train: bool,
    ) -> None:
        self.parts, self.runner, self.call, self.module = parts, parts.runner, parts.call, module
        self.step_name, self.step, self.args = step_name, getattr(module, step_name), args
        # The batch size and its micro-batches, decided once for everything this step does.
        self.mb = StepMicrobatches.of(args[0], self.runner.num_microbatches)
        self.n, self.m = self.mb.size, self.mb.count
        self.key = shape_key(args[0])
        self.recorder = LogRecorder(parts.metrics.paths if parts.metrics is not None else None)
        self.failure: Exception | None = None  # the user's step raised it on the last stage
        self.step = self._in_scope(self.step)
        self.call.train = train  # the traced path's stand-in keeps one way of calling per mode
        self.items = parts.items if step_name != "predict_step" else None
        # Items read from the call's labels: every rank counts them in training, the last stage in
        # evaluation (to weight the micro-batches' mean losses it merges).
        from_call = self.items is not None and self.items.from_call and (train or self.runner.has_last)
        needed = self.runner.needs_input(self.key, self.m, train) or from_call
        self.stage_args = self.call.capture(self.step, *args) if needed else None

    def train(self, state: StepState) -> dict[str, Any]:
        rest = self.args[1:]
        chunks, weights, counts, sizes = [], [], [], []  # what loss_fn reads: on the last stage only
        if self.runner.has_last or self.items is not None:  # (counting items is every rank's collective)
            chunks, sizes = self.mb.batch_chunks(), self.mb.sizes
            weights, counts = self._loss_weights(chunks, sizes)
        losses: list[torch.Tensor] = []
        plugin = self.module.trainer.precision_plugin

        timeline = state.observer

        def loss_fn(output: Any, index: int) -> torch.Tensor:
            with span_of(timeline, "loss_fn", "loss", mb=index):
                recording = self.recorder.recording(self.module, sizes[index], counts[index])
                with self.call.replaying(output), recording:
                    loss = loss_of(self.step(chunks[index], *rest), self.step_name)
                losses.append(loss.detach())
                # Scale the loss, not the gradients: each micro-batch carries its share of the step's
                # mean (and, under fp16, the GradScaler's scale).
                return scaled_loss(plugin, loss * weights[index])

        params = [p for p in self.module.parameters() if p.requires_grad]
        batch_idx = self.args[1] if len(self.args) > 1 else None
        earlier = earlier_gradients(self.module.trainer, self.module, batch_idx)
        if not self.runner.has_last and self.parts.mesh.pp_size > 1:
            # The last stage's loss and logs come back after the schedule: the receive waits from now.
            log_channel(self.parts, state, self.step_name).post()
        with (
            state.held.collecting(params, earlier),
            timeline.torch_schedule() if timeline else nullcontext(),
        ):
            self.runner.train_step(self.key, self.m, self.stage_args, loss_fn)
        if not self.runner.has_last:
            return {}
        return {"loss": weighted_mean([float(v) for v in torch.stack(losses).float().tolist()], counts)}

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

    def _in_scope(self, step: Any) -> Any:
        """The user's step, marked as step code while it runs; an error it raises in replay is kept.

        Kept, not raised: in training the schedule must still run every micro-batch on every stage (the
        step is then skipped and the loss is a zero of the stage's output), and :func:`run_step` sends
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

    def evaluate(self) -> dict[str, Any]:
        merge_weights = None
        if self.items is not None and self.runner.has_last:
            # A mean loss the model returns per micro-batch (labels=) merges weighted by their items.
            merge_weights = self._item_counts(self.mb.batch_chunks())
        output = self.runner.forward(self.key, self.m, self.stage_args, merge_weights)
        reshard(self.parts.sharded)  # FSDP2 stages keep their gathered weights after forward-only steps
        if not self.runner.has_last:
            return {}
        with self.call.replaying(output), self.recorder.recording(self.module, self.n):
            out = self.step(*self.args)
        return {"output": to_cpu(out) if self.step_name == "predict_step" else None}


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
