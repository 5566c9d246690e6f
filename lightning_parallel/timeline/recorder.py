"""Record what each rank does during chosen training steps, with clocks aligned across the ranks.

A :class:`Timeline` keeps timed spans (name, category, start, end, details): the stage computations and
the P2P posts and waits of torch's schedule (wrapped only while a recorded step runs, see
:mod:`~lightning_parallel.timeline._torch_hooks`), and whatever the caller times itself (the loss
function, the log broadcast, the gradient sync, the optimizer step). :meth:`Timeline.gather` brings
every rank's record of a step to rank 0 on one clock. :mod:`~lightning_parallel.timeline.report`
turns the records into a summary, a Chrome trace and a Gantt chart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_parallel.distributed.clock import clock_offsets
from lightning_parallel.distributed.collectives import all_gather_objects
from lightning_parallel.timeline._torch_hooks import patched

# category of each span: what the report adds up ("background": what ran beside the others, the
# overlapped gradient all-reduces, drawn but not added to the rank's time)
CATEGORIES = ("compute", "wait", "comm", "loss", "collective", "optimizer", "background")


@dataclass
class Event:
    """One timed span on one rank (nanoseconds on that rank's clock until :meth:`Timeline.gather`)."""

    name: str
    category: str
    start: int
    end: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepRecord:
    """What one rank did in one recorded step: its window (``begin``..``end``) and its spans."""

    step: int
    rank: int
    label: str
    begin: int
    end: int
    events: list[Event]
    replica: int = 0  # the pipeline replica (data-parallel rank) the rank belongs to


class Timeline:
    """Timed spans of the recorded steps on this rank; :meth:`gather` puts all ranks on one clock.

    Args:
        label: how this rank's track is named in the trace (e.g. ``"stages 0, 3"``).
        replica: the pipeline replica of this rank (its data-parallel rank): the report replays each
            replica's schedule on its own.

    Example::

        timeline = Timeline("stages 0")
        timeline.begin_step(5)
        with timeline.torch_schedule():          # times torch's stage compute and P2P calls
            schedule.step(x)
        with timeline.span("optimizer step", "optimizer"):
            optimizer.step()
        timeline.end_step()
        records = timeline.gather()              # a collective: on rank 0, every rank's StepRecord
    """

    def __init__(self, label: str = "", replica: int = 0) -> None:
        self.label, self.replica = label, replica
        self.events: list[Event] = []
        self._step: tuple[int, int] | None = None  # (step, begin)
        self._finished: list[StepRecord] = []

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    @property
    def recording(self) -> bool:
        return self._step is not None

    @property
    def unreported(self) -> bool:
        """Whether steps have finished since the last :meth:`gather`."""
        return bool(self._finished)

    def begin_step(self, step: int) -> None:
        self._step, self.events = (step, self.now()), []

    def end_step(self) -> None:
        assert self._step is not None, "end_step() without begin_step()"
        step, begin = self._step
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        record = StepRecord(step, rank, self.label, begin, self.now(), self.events, self.replica)
        self._finished.append(record)
        self._step, self.events = None, []

    @contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[None]:
        """Time what runs inside as one span (not recorded outside a step)."""
        start = self.now()
        try:
            yield
        finally:
            if self._step is not None:
                self.events.append(Event(name, category, start, self.now(), args))

    def add(self, name: str, category: str, start: int, end: int, **args: Any) -> None:
        """A span timed by the caller (``start`` and ``end`` from :meth:`now`)."""
        if self._step is not None:
            self.events.append(Event(name, category, start, end, args))

    def torch_schedule(self) -> Any:
        """Inside: torch's stage compute and P2P calls are timed (nothing is wrapped outside a step)."""
        return patched(self.span) if self._step is not None else nullcontext()

    def gather(self, device: Any = "cpu") -> list[StepRecord] | None:
        """Every rank's finished steps, on global rank 0's clock (a collective; None on the other ranks).

        ``device``: where the clock readings travel (``"cuda"`` under NCCL). The clocks are aligned by
        :func:`clock_offsets`: one clock per host, a few timed round trips to each other host's ranks.
        """
        finished, self._finished = self._finished, []
        if not (dist.is_available() and dist.is_initialized()):
            return finished
        offsets = clock_offsets(device)
        gathered = all_gather_objects(finished)
        if dist.get_rank() != 0:
            return None
        out = []
        for rank, records in enumerate(gathered):
            shift = -offsets[rank]
            for r in records:
                events = [Event(e.name, e.category, e.start + shift, e.end + shift, e.args) for e in r.events]
                begin, end = r.begin + shift, r.end + shift
                out.append(StepRecord(r.step, r.rank, r.label, begin, end, events, r.replica))
        return out


def span_of(timeline: Timeline | None, name: str, category: str, **args: Any) -> Any:
    """``timeline.span(...)``, or a no-op context when no timeline is recording."""
    if timeline is None or not timeline.recording:
        return nullcontext()
    return timeline.span(name, category, **args)
