"""Read recorded pipeline steps: where each rank's time went, the schedule's ideal, a trace and a chart.

The step's window is the same for every rank: from the first rank's start to the last rank's end.
Each rank's window splits into what its spans measured (stage compute, P2P posts and waits, the
loss function, collectives, the optimizer step) and what no span covers (Python between them, and
idling before or after its part of the step). The **ideal** is the schedule itself with free
communication and no overhead: every rank's compute actions, in the order and with the durations
measured, replayed with only the pipeline's dependencies (a stage's forward waits for the previous
stage's forward of that micro-batch, its backward for the next stage's backward). Its makespan
less a rank's compute is the **bubble** that schedule forces there, imbalance between stages
included; waiting beyond it is **communication wait**; the rest is **other**.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_parallel.timeline.recorder import StepRecord

# the Gantt chart's colours per span name (compute) or category
COLOURS = {
    "F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#b279a2", "wait": "#d9d9d9", "comm": "#9d755d",
    "loss": "#54a24b", "collective": "#eeca3b", "optimizer": "#72b7b2", "background": "#222222",
}  # fmt: skip
BREAKDOWN = ("loss", "collective", "optimizer", "comm")


@dataclass
class StepSummary:
    """One recorded step over all ranks: seconds per category, the ideal, and the four shares."""

    step: int
    window: float  # seconds, the same for every rank
    ranks: int
    measured: dict[str, float]  # category (and "untracked") -> seconds summed over the ranks
    ideal: float | None  # the schedule's makespan with free communication (seconds)
    compute: float
    bubble: float
    comm_wait: float
    other: float

    def line(self, what: str = "") -> str:
        """The one-line summary rank 0 prints (shares of the ranks' time, ``window x ranks``)."""
        total = self.window * self.ranks
        parts = ", ".join(
            f"{name} {self.measured.get(cat, 0.0) / total:.0%}"
            for name, cat in (("loss_fn", "loss"), ("log/grad collectives", "collective"),
                              ("optimizer", "optimizer"), ("p2p posts", "comm"), ("untracked", "untracked"))
        )  # fmt: skip
        ideal = (
            ""
            if self.ideal is None
            else f"; ideal efficiency {self.compute / (self.compute + self.bubble):.3f}"
        )
        return (
            f"pipeline timeline step {self.step}{f' ({what})' if what else ''}: {self.window * 1e3:.1f} ms, "
            f"compute {self.compute:.0%}, bubble {self.bubble:.0%} (schedule's ideal), communication wait "
            f"{self.comm_wait:.0%}, other {self.other:.0%} [{parts}]{ideal}"
        )


def by_step(records: Sequence[StepRecord]) -> dict[int, list[StepRecord]]:
    """The records grouped by step, each group sorted by rank."""
    steps: dict[int, list[StepRecord]] = defaultdict(list)
    for r in records:
        steps[r.step].append(r)
    return {s: sorted(rs, key=lambda r: r.rank) for s, rs in sorted(steps.items())}


def summarize(records: Sequence[StepRecord]) -> StepSummary:
    """Where the time of one step went (``records``: every rank's record of that step)."""
    begin, end = min(r.begin for r in records), max(r.end for r in records)
    window = (end - begin) * 1e-9
    measured: dict[str, float] = defaultdict(float)
    for r in records:
        for e in r.events:
            if e.category != "background":  # (beside the other spans: not the rank's own time)
                measured[e.category] += (e.end - e.start) * 1e-9
    measured["untracked"] = window * len(records) - sum(measured.values())
    total = window * len(records)
    compute = measured["compute"]
    replicas: dict[int, list[StepRecord]] = defaultdict(list)
    for r in records:
        replicas[r.replica].append(r)
    ideals = {g: ideal_makespan(rs) for g, rs in replicas.items()}  # each replica's schedule on its own
    ideal = None if None in ideals.values() else max(ideals.values())  # type: ignore[type-var]
    bubble = 0.0
    if ideal is not None:
        bubble = sum(ideals[g] * len(rs) - _compute(rs) for g, rs in replicas.items())  # type: ignore[operator]
        bubble = max(0.0, bubble)
    comm_wait = max(0.0, min(measured["wait"] - bubble, total - compute - bubble))
    shares = [compute / total, bubble / total, comm_wait / total]
    return StepSummary(records[0].step, window, len(records), dict(measured), ideal, *shares, 1 - sum(shares))


def _compute(records: Sequence[StepRecord]) -> float:
    return sum((e.end - e.start) * 1e-9 for r in records for e in r.events if e.category == "compute")


def ideal_makespan(records: Sequence[StepRecord]) -> float | None:
    """Seconds one replica's recorded compute takes in its schedule's order with free communication.

    ``records``: the ranks of one pipeline replica in one step. None without compute, or for an order
    the pipeline's dependencies cannot replay.

    Example::

        ideal_makespan(by_step(records)[5])    # 0.0123
    """
    queues = [[e for e in r.events if e.category == "compute"] for r in records]
    if not any(queues):
        return None
    last = max(e.args["stage"] for q in queues for e in q)
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * len(queues), [0] * len(queues)
    progressed = True
    while progressed:
        progressed = False
        for r, queue in enumerate(queues):
            while pos[r] < len(queue):
                e = queue[pos[r]]
                s, mb = e.args["stage"], e.args["mb"]
                if e.name == "F":
                    need = [("F", s - 1, mb)] if s > 0 else []
                elif e.name in ("B", "I"):
                    need = [("G", s + 1, mb)] if s < last else [("F", s, mb)]
                else:  # W: after its own stage's input gradient
                    need = [("G", s, mb)]
                if any(k not in done for k in need):
                    break
                start = max([free[r], *(done[k] for k in need)])
                free[r] = start + (e.end - e.start) * 1e-9
                done[("F" if e.name == "F" else "G" if e.name != "W" else "W", s, mb)] = free[r]
                pos[r] += 1
                progressed = True
    if any(p < len(q) for p, q in zip(pos, queues)):
        return None  # an order the dependencies cannot replay: no ideal rather than a wrong one
    return max(free)


def chrome_trace(records: Sequence[StepRecord]) -> dict[str, Any]:
    """A Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one track per rank."""
    origin = min(r.begin for r in records)
    events: list[dict[str, Any]] = []
    for rank in sorted({r.rank for r in records}):
        label = next(r.label for r in records if r.rank == rank)
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} ({label})"}}
        )
    for r in records:
        events.append(_x(f"step {r.step}", "step", r.begin, r.end, origin, r.rank, 0, {}))
        for e in r.events:  # (the background on a row of its own: it overlaps the others)
            row = 2 if e.category == "background" else 1
            events.append(_x(_title(e.name, e.args), e.category, e.start, e.end, origin, r.rank, row, e.args))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _x(name: str, cat: str, start: int, end: int, origin: int, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": (start - origin) / 1e3, "dur": (end - start) / 1e3,
            "pid": pid, "tid": tid, "args": args}  # fmt: skip


def _title(name: str, args: dict[str, Any]) -> str:
    if "stage" in args:
        return f"{name}{args['mb']} s{args['stage']}"
    return name if "mb" not in args else f"{name} {args['mb']}"


def write_trace(records: Sequence[StepRecord], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records)))
    return path


def write_gantt(records: Sequence[StepRecord], path: str | Path, title: str = "") -> Path:
    """A PNG Gantt chart of one step: a row per rank, compute labelled ``F3`` (forward of micro-batch 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(r.begin for r in records)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(records) + 1.6))
    for row, r in enumerate(records):
        for e in r.events:
            colour = COLOURS.get(e.name if e.category == "compute" else e.category, "#999999")
            x0, width = (e.start - origin) / 1e6, (e.end - e.start) / 1e6
            band = (row + 0.28, 0.12) if e.category == "background" else (row - 0.4, 0.68)
            ax.broken_barh([(x0, width)], band, facecolors=colour, edgecolor="white", linewidth=0.3)
            if e.category == "compute":
                ax.text(x0 + width / 2, row, f"{e.name}{e.args['mb']}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(records)), [f"rank {r.rank}\n{r.label}" for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(title or f"step {records[0].step}")
    names = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)",
             "wait": "P2P wait", "comm": "P2P post", "loss": "loss_fn (user step)",
             "collective": "log broadcast / grad sync", "optimizer": "optimizer step",
             "background": "gradient all-reduce (overlapped)"}  # fmt: skip
    ax.legend(handles=[Patch(color=COLOURS[k], label=v) for k, v in names.items()], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5)  # fmt: skip
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
