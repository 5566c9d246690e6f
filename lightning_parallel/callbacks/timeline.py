"""PipelineTimeline: a per-rank timeline of chosen training steps under PipelineStrategy.

Lightning glue around :mod:`lightning_parallel.timeline.recorder` (the recorder) and
:mod:`~lightning_parallel.timeline.report` (summary, Chrome trace, Gantt chart).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.timeline.recorder import StepRecord, Timeline
from lightning_parallel.timeline.report import by_step, summarize, write_gantt, write_trace


class PipelineTimeline(Callback):
    """Record what every rank does in chosen training batches: a trace, a Gantt chart, a summary line.

    Per rank and micro-batch: each forward, backward (input and weight halves under the zero-bubble
    schedules), P2P post and wait, the loss function (the user's step on the last stage), the log
    broadcast, the gradient sync and the optimizer step, on one clock across the ranks. For each
    recorded batch global rank 0 prints one line (compute, bubble against the schedule's ideal,
    communication wait and other, as shares of the ranks' time) and writes ``step_<N>.png`` (a
    Gantt chart); ``trace.json`` (Chrome / Perfetto: one track per rank) holds every recorded
    batch. Nothing is wrapped or timed in the batches not recorded. The records are gathered, and
    the lines and files written, after the last batch of each run of consecutive recorded batches
    (or when training ends): that work delays the next batch on rank 0, so it never precedes a
    recorded one.

    Args:
        steps: the training batches to record, counted from 0 over the whole fit (the global step
            without gradient accumulation). Skip the first one or two: they build the schedule.
        dirpath: where the files go (default: ``<trainer.log_dir or default_root_dir>/pipeline_timeline``).
        charts: write the Gantt chart of each recorded batch (matplotlib; about half a second each).

    Example::

        trainer = L.Trainer(devices=2, strategy=PipelineStrategy(num_microbatches=8),
                            callbacks=[PipelineTimeline(steps=[5, 6], dirpath="timeline")])
        trainer.fit(model)     # after batch 6: "pipeline timeline step 5 (1f1b p=2 m=8): 41.2 ms, ...",
                               # then the same line for step 6
    """

    @checks_options
    def __init__(
        self, steps: Iterable[int] = (5,), dirpath: str | Path | None = None, charts: bool = True
    ) -> None:
        steps = list(steps)
        if not steps or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise ValueError(f"steps must be a non-empty list of batch indices >= 0, got {steps!r}")
        self.steps = sorted(set(steps))
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.charts = charts
        self.records: list[StepRecord] = []  # on global rank 0: every recorded batch of every rank
        self._batches = 0
        self._timeline: Timeline | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_parallel.strategies.pipeline.strategy import PipelineStrategy

        if not isinstance(trainer.strategy, PipelineStrategy):
            raise ValueError(
                f"PipelineTimeline records the schedule of PipelineStrategy, but the Trainer runs "
                f"{type(trainer.strategy).__name__}: pass strategy=PipelineStrategy(...), or drop the "
                f"callback"
            )
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "pipeline_timeline"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timeline = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        parts = trainer.strategy.parts
        if self._batches in self.steps and parts is not None:
            if self._timeline is None:
                indices = [s.index for s in parts.plan.local_stages(parts.mesh.pp_rank)]
                label = f"stage{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"
                replica = parts.mesh.rank("data")
                if parts.mesh.size("data") > 1:
                    label += f", replica {replica}"
                self._timeline = Timeline(label, replica)
            trainer.strategy.step_state.register(self._timeline)
            self._timeline.begin_step(self._batches)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self._batches += 1
        if self._timeline is None or not self._timeline.recording:
            return
        self._timeline.end_step()
        trainer.strategy.step_state.unregister(self._timeline)
        # The gather (a collective) and rank 0's writing hold rank 0 back while the other ranks start
        # the next batch: not before a recorded batch, which would count it as their waiting.
        if self._batches not in self.steps:
            self._report(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timeline is not None and self._timeline.unreported:  # the fit ended in a recorded run
            self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        """Gather the finished records (every rank), then on global rank 0 print and write them."""
        assert self._timeline is not None
        records = self._timeline.gather(trainer.strategy.root_device)  # None except on rank 0
        if records is None:
            return
        self.records += records
        strategy = trainer.strategy
        plan = strategy.parallel_plan
        what = f"{plan.schedule} p={strategy.pipeline_size} m={plan.num_microbatches}"
        assert self.dirpath is not None
        for step, step_records in by_step(records).items():
            rank_zero_info(summarize(step_records).line(what))
            if self.charts:
                write_gantt(step_records, self.dirpath / f"step_{step}.png", f"batch {step}: {what}")
        write_trace(self.records, self.dirpath / "trace.json")
