"""What the last stage hands the other ranks after a step: its loss and logs (or its error), replayed
through ``self.log`` on every rank; a prediction run's outputs, collected on global rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.collectives import (
    all_gather_objects,
    broadcast_object,
    recv_object,
    send_object,
)
from lightning_parallel.distributed.record_broadcast import RecordBroadcast
from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.pipeline.metrics import StageMetrics, replay_step_value
from lightning_parallel.pipeline.predictions import interleave_replicas
from lightning_parallel.pipeline.step_logs import LoggedMetric

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_parallel.strategies.pipeline.build import PipelineParts


def count_predict_batches(parts: PipelineParts, trainer: Any) -> None:
    """How many batches each replica predicts (the sampler does not pad), on every rank: rank 0 must
    know which replicas send it predictions at each step. A collective (every rank, before predicting)."""
    if parts.mesh.dp_size == 1:
        return
    counts = all_gather_objects(int(sum(trainer.num_predict_batches)))
    last = last_pp_rank(parts)
    parts.predict_batches = [counts[parts.mesh.global_rank(last, r)] for r in range(parts.mesh.dp_size)]


def collect_predictions(parts: PipelineParts, output: Any, batch_idx: int) -> Any:
    """Send each replica's predictions of this batch step to global rank 0, in dataset order there.

    Replicas may run different numbers of batches (the prediction sampler does not pad): rank 0,
    whose replica runs the most, receives from every replica that has batch ``batch_idx``.
    """
    mesh, counts = parts.mesh, parts.predict_batches
    assert counts is not None
    last = last_pp_rank(parts)
    if mesh.tp_rank > 0:  # its tensor-parallel rank 0 holds the same predictions
        return None
    if mesh.pp_rank == last and mesh.dp_rank > 0:
        send_object(output, dst=0)
        return None
    if mesh.global_rank(mesh.pp_rank) != 0:
        return None
    received = [output]
    for replica in range(1, mesh.dp_size):
        if batch_idx < counts[replica]:
            received.append(recv_object(src=mesh.global_rank(last, replica)))
    return interleave_replicas(received)


def last_pp_rank(parts: PipelineParts) -> int:
    """The pipeline rank holding the last stage: ``p - 1``, or 0 under a V placement (ZBV, DualPipeV)."""
    return parts.plan.pp_rank_of(parts.plan.num_stages - 1)


def from_last_stage(result: dict[str, Any], mesh: PipelineMesh, last: int) -> dict[str, Any]:
    """Broadcast the step result (any picklable object) from pipeline rank ``last`` to this replica."""
    if mesh.pp_size == 1:
        return result
    return broadcast_object(result, src=mesh.global_rank(last), group=mesh.pp_group)


def numbers_from_last_stage(
    parts: PipelineParts, step_name: str, record: tuple | None, error: BaseException | None = None
) -> tuple[Any, list[float]]:
    """The last stage's loss and logged numbers on every stage of this replica: one small tensor broadcast.

    One channel per step method keeps each one's layout (log names and options) agreed across steps.
    ``error`` (on the last stage): sent instead, and raised on every stage.
    """
    if parts.mesh.pp_size == 1:
        if error is not None:
            raise error
        assert record is not None
        return record
    return log_channel(parts, step_name).broadcast(record, error=error)


def log_channel(parts: PipelineParts, step_name: str) -> RecordBroadcast:
    """The last stage's channel to this replica's stages for ``step_name`` (created at its first use)."""
    channel = parts.channels.get(step_name)
    if channel is None:
        mesh = parts.mesh
        channel = parts.channels[step_name] = RecordBroadcast(
            mesh.global_rank(last_pp_rank(parts)), mesh.pp_group
        )
    return channel


def replay_logs(
    module: pl.LightningModule,
    logs: list[tuple[str, Any, dict[str, Any]]],
    dp_group: Any,
    metrics: StageMetrics | None = None,
) -> None:
    """Log the last stage's combined values through the real ``self.log`` on this rank.

    A logged Metric is logged as this rank's copy of it (the module's attribute at its path), carrying
    the last stage's step value; its ``compute()`` returns the last stage's value (``metrics``).

    A value logged without ``sync_dist``: with one replica (a data-parallel group of one rank) every
    rank logs the same value, the last stage's, so it is synced already; it is logged as such
    (``sync_dist=True`` over that group, whose reduction is the value itself: no collective), and
    Lightning does not advise ``sync_dist=True`` for it at the epoch's end. With several replicas
    their values differ, and the advice stands.
    """
    one_replica = dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) == 1
    for name, value, kwargs in logs:
        if isinstance(value, LoggedMetric):
            metric = module.get_submodule(value.path)
            if metrics is not None:
                metrics.adapt(metric)  # a metric made after setup
            if metrics is None or not metrics.is_last:
                step = None if value.value is None else torch.tensor(value.value, device=metric.device)
                replay_step_value(metric, step)
            module.log(name, metric, metric_attribute=value.path, **kwargs)
            continue
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            # Every stage holds the same values: reduce over the replicas only.
            kwargs = {**kwargs, "sync_dist_group": dp_group}
        elif one_replica and not kwargs.get("sync_dist"):
            kwargs = {**kwargs, "sync_dist": True, "sync_dist_group": dp_group}
        module.log(name, value, **kwargs)
