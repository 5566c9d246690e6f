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
    runner, proxy, mesh = strategy._runner, strategy._proxy, strategy.mesh
    assert runner is not None and proxy is not None and mesh is not None
    module = strategy.lightning_module
    n = batch_size(args[0])
    m = runner.microbatches_for(n)
    stage_args = proxy.capture(getattr(module, step_name), *args) if runner.has_first else None
    recorder = LogRecorder()
    if train:
        result = _train(strategy, step_name, args, m, stage_args, recorder)
    else:
        result = _evaluate(strategy, step_name, args, m, stage_args, recorder)
    if runner.has_last:
        result["logs"] = recorder.entries()
    result = from_last_stage(result, mesh)
    replay_logs(module, result["logs"], mesh.dp_group)
    if train:
        return torch.tensor(result["loss"], device=strategy.root_device)
    if step_name == "predict_step" and mesh.dp_size > 1:
        return collect_predictions(strategy, result.get("output"), batch_idx=args[1])
    return result.get("output")


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


def _train(
    strategy: PipelineStrategy,
    step_name: str,
    args: tuple[Any, ...],
    m: int,
    stage_args: tuple[Any, ...] | None,
    recorder: LogRecorder,
) -> dict[str, Any]:
    module, runner, proxy = strategy.lightning_module, strategy._runner, strategy._proxy
    step = getattr(module, step_name)
    batch, rest = args[0], args[1:]
    n = batch_size(batch)
    chunks = [c[0] for c in split_args_kwargs_into_chunks((batch,), None, m)[0]]
    scale = 1.0 / module.trainer.accumulate_grad_batches
    losses: list[tuple[torch.Tensor, int]] = []

    def loss_fn(output: Any, index: int) -> torch.Tensor:
        n_i = batch_size(chunks[index])
        with proxy.replaying(output), recorder.recording(module, n_i):
            loss = loss_of(step(chunks[index], *rest), step_name)
        losses.append((loss.detach(), n_i))
        # Scale the loss, not the gradients: each micro-batch carries its share of the batch
        # mean, and of the accumulation window.
        return loss * (n_i / n * scale)

    with strategy._grads_held_for_backward():
        runner.train_step(shape_key(batch), m, stage_args, loss_fn)
    if not runner.has_last:
        return {}
    return {"loss": float(sum(loss.float() * n_i for loss, n_i in losses) / n)}


def _evaluate(
    strategy: PipelineStrategy,
    step_name: str,
    args: tuple[Any, ...],
    m: int,
    stage_args: tuple[Any, ...] | None,
    recorder: LogRecorder,
) -> dict[str, Any]:
    module, runner, proxy = strategy.lightning_module, strategy._runner, strategy._proxy
    output = runner.forward(shape_key(args[0]), m, stage_args)
    if not runner.has_last:
        return {}
    with proxy.replaying(output), recorder.recording(module, batch_size(args[0])):
        out = getattr(module, step_name)(*args)
    return {"output": to_cpu(out) if step_name == "predict_step" else None}


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
