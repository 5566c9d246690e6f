"""One Lightning step through the pipeline: capture the input, run the schedule, return loss and logs.

The user's step runs unchanged: on the first stage up to its call of the pipelined Sequential (to
capture that call's input), on the last stage around the pipeline's output (once per micro-batch in
training, as the schedule's loss function; once per batch in evaluation). What it logs and returns
is sent from the last stage to every stage of the replica and logged there through ``self.log``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from lightning_parallel.pipeline.mesh import PipelineMesh
from lightning_parallel.pipeline.predictions import interleave_replicas
from lightning_parallel.pipeline.state import to_cpu
from lightning_parallel.pipeline.step_logs import LoggedValue, LogRecorder

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_parallel.strategies.pipeline import PipelineStrategy


def run_step(strategy: PipelineStrategy, step_name: str, args: tuple[Any, ...], train: bool) -> Any:
    """Run ``step_name`` (``training_step``, ...) for one batch through the pipeline."""
    mesh = strategy.mesh
    assert mesh is not None
    step = _Step(strategy, step_name, args)
    result = step.train() if train else step.evaluate()
    if step.runner.has_last:
        result["logs"] = step.recorder.entries()
    result = from_last_stage(result, mesh)
    replay_logs(step.module, result["logs"], mesh.dp_group)
    if train:
        return torch.tensor(result["loss"], device=strategy.root_device)
    if step_name == "predict_step" and mesh.dp_size > 1:
        return collect_predictions(strategy, result.get("output"), batch_idx=args[1])
    return result.get("output")


class _Step:
    """One batch of one step method on this rank: the input capture, then training or evaluation."""

    def __init__(self, strategy: PipelineStrategy, step_name: str, args: tuple[Any, ...]) -> None:
        assert strategy._runner is not None and strategy._proxy is not None
        self.strategy, self.runner, self.proxy = strategy, strategy._runner, strategy._proxy
        self.module = strategy.lightning_module
        self.step_name, self.step, self.args = step_name, getattr(self.module, step_name), args
        self.n = batch_size(args[0])
        self.m = self.runner.microbatches_for(self.n)
        self.recorder = LogRecorder()
        self.stage_args = self.proxy.capture(self.step, *args) if self.runner.has_first else None

    def train(self) -> dict[str, Any]:
        batch, rest = self.args[0], self.args[1:]
        chunks = [c[0] for c in split_args_kwargs_into_chunks((batch,), None, self.m)[0]]
        scale = 1.0 / self.module.trainer.accumulate_grad_batches
        losses: list[tuple[torch.Tensor, int]] = []

        def loss_fn(output: Any, index: int) -> torch.Tensor:
            n_i = batch_size(chunks[index])
            with self.proxy.replaying(output), self.recorder.recording(self.module, n_i):
                loss = loss_of(self.step(chunks[index], *rest), self.step_name)
            losses.append((loss.detach(), n_i))
            # Scale the loss, not the gradients: each micro-batch carries its share of the batch
            # mean, and of the accumulation window.
            return loss * (n_i / self.n * scale)

        with self.strategy._grads_held_for_backward():
            self.runner.train_step(shape_key(batch), self.m, self.stage_args, loss_fn)
        if not self.runner.has_last:
            return {}
        return {"loss": float(sum(loss.float() * n_i for loss, n_i in losses) / self.n)}

    def evaluate(self) -> dict[str, Any]:
        output = self.runner.forward(shape_key(self.args[0]), self.m, self.stage_args)
        if not self.runner.has_last:
            return {}
        with self.proxy.replaying(output), self.recorder.recording(self.module, self.n):
            out = self.step(*self.args)
        return {"output": to_cpu(out) if self.step_name == "predict_step" else None}


def collect_predictions(strategy: PipelineStrategy, output: Any, batch_idx: int) -> Any:
    """Send each replica's predictions of this batch step to global rank 0, in dataset order there.

    Replicas may run different numbers of batches (the prediction sampler does not pad): rank 0,
    whose replica runs the most, receives from every replica that has batch ``batch_idx``.
    """
    mesh, counts = strategy.mesh, strategy._predict_batches
    assert mesh is not None and counts is not None
    last = mesh.pp_size - 1
    if mesh.pp_rank == last and mesh.dp_rank > 0:
        dist.send_object_list([output], dst=0)
        return None
    if not strategy.is_global_zero:
        return None
    parts = [output]
    for replica in range(1, mesh.dp_size):
        if batch_idx < counts[replica]:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=mesh.global_rank(last, replica))
            parts.append(box[0])
    return interleave_replicas(parts)


def from_last_stage(result: dict[str, Any], mesh: PipelineMesh) -> dict[str, Any]:
    """Broadcast the last stage's step result to every stage of this replica."""
    if mesh.pp_size == 1:
        return result
    box = [result]
    dist.broadcast_object_list(box, src=mesh.global_rank(mesh.pp_size - 1), group=mesh.pp_group)
    return box[0]


def replay_logs(module: pl.LightningModule, entries: list[LoggedValue], dp_group: Any) -> None:
    """Log the last stage's combined values through the real ``self.log`` on this rank."""
    for entry in entries:
        kwargs = entry.replay_kwargs()
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            # Every stage holds the same values: reduce over the replicas only.
            kwargs["sync_dist_group"] = dp_group
        module.log(entry.name, entry.combined(), **kwargs)


def batch_size(batch: Any) -> int:
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if torch.is_tensor(leaf) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise TypeError(f"PipelineStrategy could not find a batched tensor in the batch ({type(batch).__name__})")


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
