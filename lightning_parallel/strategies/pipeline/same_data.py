"""Every rank of a replica reads the same samples: the loaders' samplers, then the first batches checked.

Each rank loads the batch from its own loader (the first stage uses the inputs, the last the labels):
a sampler split over the world instead of the replicas would pair one sample's activations with
another sample's labels, with no error. Lightning calls ``process_dataloader`` for every train, val,
test and predict loader: a distributed sampler split over the world is set to the replicas there
(:mod:`lightning_parallel.data.sampler_layout`), another layout is refused before any step; whatever
else differs (a rank-dependent data set, a sampler that is not distributed) is caught by comparing
the first training batches' fingerprints (:mod:`lightning_parallel.data.batch_fingerprint`). The
first training batch is also checked against the micro-batches (after the comparison: a batch that
differs between ranks would fail that check on some ranks only).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel.data.batch_fingerprint import check_same_batch
from lightning_parallel.data.sampler_layout import fit_samplers_to_replicas
from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.pipeline.microbatches import check_feeds

COMPARED_BATCHES = 3  # the first training batches of each fit (a few small collectives, then none)


class SameData:
    """A mixin of ``PipelineStrategy``: its ``process_dataloader``, and the first training batches checked.

    Reads the strategy's ``parts``, ``parallel_plan``, ``distributed_sampler_kwargs``, ``world_size`` and
    ``global_rank``. Example: ``self._check_training_batch(args)`` (the training step's ``batch,
    batch_idx``) at each training step.
    """

    parts: Any
    parallel_plan: Any
    distributed_sampler_kwargs: dict[str, Any]
    world_size: int
    global_rank: int
    _batches_compared: int = 0
    _batch_warned: bool = False
    _first_batch_checked: bool = False

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        layout = self.distributed_sampler_kwargs
        with failing_together():  # every rank prepares its loaders at the same point (Lightning's barrier)
            notes = fit_samplers_to_replicas(
                dataloader, layout["num_replicas"], layout["rank"], self.world_size, self.global_rank
            )
        for note in notes:
            rank_zero_info(f"PipelineStrategy: {note}")
        return dataloader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._batches_compared = 0

    def _check_training_batch(self, step_args: tuple[Any, ...]) -> None:
        self._compare_batch(step_args[0], step_args[1] if len(step_args) > 1 else None)
        if not self._first_batch_checked:
            # Later batches may be short (an epoch's last); the first one shows the configured size.
            self._first_batch_checked = True
            check_feeds(step_args[0], self.parallel_plan.num_microbatches)

    def _compare_batch(self, batch: Any, batch_idx: Any) -> None:
        """On the first training batches: the ranks of each replica must hold the same batch (every rank)."""
        parts = self.parts
        if self._batches_compared >= COMPARED_BATCHES or parts is None:
            return
        self._batches_compared += 1
        if parts.mesh.pp_size * parts.mesh.tp_size == 1:
            return  # a replica is one rank: nothing to compare
        warnings = check_same_batch(batch, parts.mesh.rank("data"), parts.mesh.pp_rank, batch_idx)
        if warnings and not self._batch_warned:
            self._batch_warned = True
            rank_zero_warn(f"PipelineStrategy: {warnings[0]}")
