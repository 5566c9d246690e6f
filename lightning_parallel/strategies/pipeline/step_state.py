"""What PipelineStrategy's steps keep between them on this rank: the state beside the build product.

The build (``build.py: PipelineParts``) is what the split and the techniques made, and nothing changes it
after; a :class:`StepState` holds what the steps themselves carry from one step to the next: the gradients
held aside for Lightning's backward, each replica's prediction count, the last stage's channels, and the
observer (a :class:`~lightning_parallel.timeline.recorder.Timeline`) the ``PipelineTimeline`` callback
registers while it records a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_parallel.distributed.record_broadcast import RecordBroadcast
from lightning_parallel.grads.held import HeldGradients
from lightning_parallel.techniques.job import StepPhase
from lightning_parallel.timeline.recorder import Timeline


@dataclass
class StepState:
    """This rank's steps' own state, one per strategy (``strategy.step_state``).

    Args:
        held: this batch's gradients, kept aside from the schedule until Lightning's backward.
        predict_batches: in a prediction run, how many batches each replica predicts (the sampler does
            not pad), or None.
        channels: the last stage's channel to its replica's stages, per step method (made at first use).
        phase: what the training batch about to run is to the optimizer step (the techniques' job reads
            it: the overlapped reduction starts only in a window's last batch).

    Example::

        state = trainer.strategy.step_state
        state.register(timeline)                  # PipelineTimeline, at a recorded batch's start
        with span_of(state.observer, "log broadcast", "collective"):   # the step code
            ...
        state.unregister(timeline)                # at the batch's end
    """

    held: HeldGradients = field(default_factory=HeldGradients)
    predict_batches: list[int] | None = None
    channels: dict[str, RecordBroadcast] = field(default_factory=dict)
    phase: StepPhase = field(default_factory=StepPhase)
    _observer: Timeline | None = None

    def register(self, observer: Timeline) -> None:
        """Time the steps' spans into ``observer`` (while it records a step)."""
        self._observer = observer

    def unregister(self, observer: Timeline) -> None:
        """Stop timing into ``observer`` (no-op if another one is registered)."""
        if self._observer is observer:
            self._observer = None

    @property
    def observer(self) -> Timeline | None:
        """The registered timeline while it records a step, else None: the steps time nothing."""
        observer = self._observer
        return observer if observer is not None and observer.recording else None
