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
    from lightning_parallel.strategies.pipeline.step_state import StepState


def count_predict_batches(parts: PipelineParts, state: StepState, trainer: Any) -> None:
    """How many batches each replica predicts (the sampler does not pad), on every rank: rank 0 must
    know which replicas send it predictions at each step. A collective (every rank, before predicting)."""
    if parts.mesh.size("predictions") == 1:
        return
    counts = all_gather_objects(int(sum(trainer.num_predict_batches)))
    state.predict_batches = [counts[rank] for rank in prediction_senders(parts)]


def collect_predictions(parts: PipelineParts, state: StepState, output: Any, batch_idx: int) -> Any:
    """Send each replica's predictions of this batch step to global rank 0, in dataset order there.

    Replicas may run different numbers of batches (the prediction sampler does not pad): rank 0,
    whose replica runs the most, receives from every replica that has batch ``batch_idx``.
    """
    counts = state.predict_batches
    assert counts is not None
    senders = prediction_senders(parts)
    if parts.mesh.world_rank in senders[1:]:
        send_object(output, dst=0)
        return None
    if parts.mesh.world_rank != 0:  # (global rank 0 holds replica 0's, broadcast over its pipeline)
        return None
    received = [output]
    for replica in range(1, len(senders)):
        if batch_idx < counts[replica]:
            received.append(recv_object(src=senders[replica]))
    return interleave_replicas(received)


def prediction_senders(parts: PipelineParts) -> list[int]:
    """The last stage's rank of each replica whose predictions global rank 0 collects, replica 0 first:
    the ``"predictions"`` group of the last stage of global rank 0's pipeline (its other ranks, its
    tensor-parallel peers, hold the same predictions and send none)."""
    first_pipeline = parts.mesh.layout.group_of("pipeline", 0)
    return parts.mesh.members("predictions", of=first_pipeline[last_pp_rank(parts)])


def last_pp_rank(parts: PipelineParts) -> int:
    """The pipeline rank holding the last stage: ``p - 1``, or 0 under a V placement (ZBV, DualPipeV)."""
    return parts.plan.pp_rank_of(parts.plan.num_stages - 1)


def from_last_stage(result: dict[str, Any], mesh: PipelineMesh, last: int) -> dict[str, Any]:
    """Broadcast the step result (any picklable object) from pipeline rank ``last`` to this replica."""
    if mesh.pp_size == 1:
        return result
    return broadcast_object(result, src=mesh.global_rank(last), group=mesh.pp_group)


def numbers_from_last_stage(
    parts: PipelineParts,
    state: StepState,
    step_name: str,
    record: tuple | None,
    error: BaseException | None = None,
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
    return log_channel(parts, state, step_name).broadcast(record, error=error)


def log_channel(parts: PipelineParts, state: StepState, step_name: str) -> RecordBroadcast:
    """The last stage's channel to this replica's stages for ``step_name`` (created at its first use)."""
    channel = state.channels.get(step_name)
    if channel is None:
        mesh = parts.mesh
        channel = state.channels[step_name] = RecordBroadcast(
            mesh.global_rank(last_pp_rank(parts)), mesh.pp_group
        )
    return channel


def replay_logs(
    module: pl.LightningModule,
    logs: list[tuple[str, Any, dict[str, Any]]],
    group: Any,
    metrics: StageMetrics | None = None,
) -> None:
    """Log the last stage's combined values through the real ``self.log`` on this rank; a
    ``sync_dist=True`` value is reduced over ``group`` (``mesh.group("logs")``).

    A logged Metric is logged as this rank's copy of it (the module's attribute at its path), carrying
    the last stage's step value; its ``compute()`` returns the last stage's value (``metrics``).

    A value logged without ``sync_dist``: with one replica (a data-parallel group of one rank) every
    rank logs the same value, the last stage's, so it is synced already; it is logged as such
    (``sync_dist=True`` over that group, whose reduction is the value itself: no collective), and
    Lightning does not advise ``sync_dist=True`` for it at the epoch's end. With several replicas
    their values differ, and the advice stands.
    """
    one_replica = group is not None and dist.is_initialized() and dist.get_world_size(group) == 1
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
            kwargs = {**kwargs, "sync_dist_group": group}
        elif one_replica and not kwargs.get("sync_dist"):
            kwargs = {**kwargs, "sync_dist": True, "sync_dist_group": group}
        module.log(name, value, **kwargs)
