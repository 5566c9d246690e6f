"""Pipeline schedules side by side on 2 CPU processes, with the timeline: where each one's time goes.

The byte-level LM of ``models.py`` (its ``nn.Sequential`` form, dim 128, 4 blocks: 7 layers, split into
stages balanced by parameter count), batch 32 x 64 bytes, m = 8 micro-batches, p = 2, trained under
``PipelineStrategy`` with ``1f1b`` (2 stages), ``interleaved_1f1b`` and ``interleaved_zero_bubble``
(4 stages, looped), ``zbv`` and ``dualpipev`` (4 stages, V placement), and one process training the
whole model with the same 8 micro-batches while the other process does the same (the baseline of the
efficiency, as in ``bench_pipeline.py``). The variants run interleaved (first one rotating),
``--repeats`` times. Per pipeline run:

- **throughput**: the batch over the median step cycle of the timed steps (no timeline recording), and
  the **efficiency**: that over p x the one-process throughput of the same repeat;
- **the timeline** (``PipelineTimeline``) of the recorded steps after them: compute, bubble against the
  schedule's ideal (the recorded compute replayed with free communication), communication wait and
  other, as shares of the ranks' time, the measured idle share (1 - compute), and the **compute
  inflation**: the ranks' stage compute over the one-process step time (above 1: the layers run
  slower as pipeline stages than in one process);
- **peak activation memory per rank** (the bytes autograd saves, ``_meters.SavedTensorMeter``, as
  ``bench_pipeline_memory.py`` counts them), in one extra short run per schedule after the timed ones.

Writes ``schedules.csv`` (medians and ranges), ``schedules.png`` (time shares and throughput), and the
Gantt chart of one recorded 1F1B step and of one ZBV step (``timeline_1f1b.png``, ``timeline_zbv.png``).

Usage::

    python experiments/bench_schedules.py             # about 2 minutes on 2 idle cores
    python experiments/bench_schedules.py --quick     # a tiny model, one step each: checks that it runs
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as h
import _tables as t
from _charlm_bench import Config, build_model, loader, run_single
from _meters import SavedTensorMeter
from lightning.pytorch.callbacks import Callback

from lightning_parallel import PipelineStrategy, PipelineTimeline
from lightning_parallel.timeline.report import by_step, summarize, write_gantt

P, M = 2, 8
SCHEDULES = {  # name -> stages_per_rank (None: implied)
    "1f1b": None,
    "interleaved_1f1b": 2,
    "interleaved_zero_bubble": 2,
    "zbv": None,
    "dualpipev": None,
}
SHARES = ("compute", "bubble", "comm_wait", "other")
BREAKDOWN = ("wait", "loss", "collective", "optimizer", "comm", "untracked")


@dataclass
class Bench:
    warmup: int = 2
    steps: int = 5  # timed, not recorded
    recorded: int = 2  # recorded with the timeline, after the timed ones
    repeats: int = h.MIN_REPEATS
    memory_steps: int = 3  # of the extra run per schedule that counts activation bytes


class _Meter(Callback):
    """Peak activation bytes of this rank over the fit (see _meters.SavedTensorMeter)."""

    def __init__(self) -> None:
        self.meter: SavedTensorMeter | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.meter = SavedTensorMeter(list(pl_module.parameters()))
        self.meter.hooks.__enter__()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        assert self.meter is not None
        self.meter.hooks.__exit__(None, None, None)


def run_schedule(cfg: Config, bench: Bench, schedule: str, tmp: str, gantt: Path | None) -> dict[str, Any]:
    """One fit: throughput over the timed steps, then the timeline of the recorded ones (rank 0)."""
    clock = h.StepClock()
    first = bench.warmup + bench.steps
    timeline = PipelineTimeline(steps=list(range(first, first + bench.recorded)), dirpath=tmp, charts=False)
    spr = SCHEDULES[schedule]
    strategy = PipelineStrategy(
        pipeline_size=P, num_microbatches=M, schedule=schedule, partition="parameters",
        **({"stages_per_rank": spr} if spr else {}),
    )  # fmt: skip
    total = first + bench.recorded
    trainer = h.quiet_trainer(
        devices=P, strategy=strategy, max_steps=total, limit_val_batches=0, callbacks=[clock, timeline]
    )
    trainer.fit(build_model(cfg), train_dataloaders=loader(cfg, total))
    starts = clock.starts[bench.warmup : first + 1]  # cycles of the timed steps only
    out: dict[str, Any] = dict(
        samples_per_s=cfg.batch_size / statistics.median(b - a for a, b in itertools.pairwise(starts))
    )
    if timeline.records:  # global rank 0
        summaries = [summarize(r) for r in by_step(timeline.records).values()]
        for key in SHARES:
            out[key] = statistics.median(getattr(s, key) for s in summaries)
        out["step_compute_s"] = statistics.median(s.measured["compute"] for s in summaries)
        for cat in BREAKDOWN:  # the parts of "other" (and the P2P waits), as shares of the ranks' time
            out[f"{cat}_share"] = statistics.median(
                s.measured.get(cat, 0.0) / (s.window * s.ranks) for s in summaries
            )
        out["ideal_efficiency"] = statistics.median(s.compute / (s.compute + s.bubble) for s in summaries)
        if gantt is not None:
            step, records = next(iter(by_step(timeline.records).items()))
            write_gantt(
                records, gantt, f"{schedule}, p={P}, m={M}: one step (batch {step}) of bench_schedules.py"
            )
    return out


def memory_run(cfg: Config, schedule: str, steps: int) -> int:
    """Peak activation bytes on this rank over ``steps`` steps."""
    meter = _Meter()
    spr = SCHEDULES[schedule]
    strategy = PipelineStrategy(
        pipeline_size=P, num_microbatches=M, schedule=schedule, partition="parameters",
        **({"stages_per_rank": spr} if spr else {}),
    )  # fmt: skip
    trainer = h.quiet_trainer(
        devices=P, strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=[meter]
    )
    trainer.fit(build_model(cfg), train_dataloaders=loader(cfg, steps))
    assert meter.meter is not None
    return meter.meter.peak


def worker(rank: int, world: int, cfg: Config, bench: Bench, out_dir: Path) -> dict[str, Any]:
    gantt = {s: out_dir / f"timeline_{s}.png" for s in ("1f1b", "zbv")}
    tmp = tempfile.mkdtemp(prefix="lp-timeline-")
    done: set[str] = set()

    def once(s: str) -> Path | None:  # the Gantt chart of the first repeat's first recorded step
        if s in gantt and s not in done:
            done.add(s)
            return gantt[s]
        return None

    variants: dict[str, Any] = {"single": lambda: run_single(cfg, M, bench.steps)}
    for s in SCHEDULES:
        variants[s] = lambda s=s: run_schedule(cfg, bench, s, tmp, once(s))
    samples = h.interleave(variants, bench.repeats, before_each=h.barrier)
    memory = {s: memory_run(cfg, s, bench.memory_steps) for s in SCHEDULES}
    shutil.rmtree(tmp, ignore_errors=True)
    return dict(samples=samples, memory=memory)


def rows_of(cfg: Config, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    samples = ranks[0]["samples"]
    single = {
        x["repeat"]: statistics.mean(r["samples"][i]["samples_per_s"] for r in ranks)
        for i, x in enumerate(samples) if x["variant"] == "single"
    }  # fmt: skip
    single_step = {x["repeat"]: x["step_ms"] / 1e3 for x in samples if x["variant"] == "single"}
    one_f1b = {x["repeat"]: x["samples_per_s"] for x in samples if x["variant"] == "1f1b"}
    rows = []
    for s in SCHEDULES:
        mine = [x for x in samples if x["variant"] == s]
        row: dict[str, Any] = dict(
            schedule=s, pipeline_size=P, num_microbatches=M, batch_size=cfg.batch_size, repeats=len(mine),
            ideal_1f1b_bubble_efficiency=round(M / (M + P - 1), 4),
        )  # fmt: skip
        row |= h.spread(x["samples_per_s"] for x in mine).cells("samples_per_s", 2)
        row |= h.spread(single.values()).cells("one_process_samples_per_s", 2)
        row |= h.spread(x["samples_per_s"] / (P * single[x["repeat"]]) for x in mine).cells("efficiency", 4)
        row |= h.spread(x["samples_per_s"] / one_f1b[x["repeat"]] for x in mine).cells("vs_1f1b", 4)
        for key in (*SHARES, "ideal_efficiency"):
            row |= h.spread(x[key] for x in mine).cells(key, 4)
        row |= h.spread(1 - x["compute"] for x in mine).cells("idle", 4)
        for cat in BREAKDOWN:
            row[f"{cat}_share"] = round(h.spread(x[f"{cat}_share"] for x in mine).median, 4)
        row |= h.spread(x["step_compute_s"] / single_step[x["repeat"]] for x in mine).cells(
            "compute_inflation", 3
        )
        for rank, r in enumerate(ranks):
            row[f"activation_peak_mib_rank{rank}"] = round(r["memory"][s] / 2**20, 2)
        rows.append(row)
    return rows


def plot(path: Path, rows: list[dict[str, Any]], repeats: int, cfg: Config) -> None:
    fig, (left, right) = h.figure(2)
    names = [r["schedule"] for r in rows]
    bottom = [0.0] * len(rows)
    colours = {"compute": "#4c78a8", "bubble": "#d9d9d9", "comm_wait": "#f58518", "other": "#54a24b"}
    for key in SHARES:
        values = [float(r[key]) for r in rows]
        left.bar(names, values, bottom=bottom, color=colours[key], label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set(
        ylabel="share of the ranks' step time", title="Where the step goes (timeline, medians)", ylim=(0, 1)
    )
    left.legend(fontsize=8)
    h.errorbars(right, names, rows, "efficiency", fmt="o", label="measured efficiency")
    right.plot(
        names, [float(r["ideal_efficiency"]) for r in rows], "k_", markersize=14, label="schedule's ideal"
    )
    right.set(
        ylabel="throughput / (p x one process)", title="Efficiency against p x one process", ylim=(0, 1.05)
    )
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"CharLM dim {cfg.dim}, {cfg.depth} blocks, p={P}, m={M}, 2 CPU processes (gloo); "
                 f"medians of {repeats} interleaved repeats, bars: min-max", fontsize=8)  # fmt: skip
    h.save_figure(fig, path)


COLUMNS = [
    "schedule", "pipeline_size", "num_microbatches", "batch_size", "repeats",
    "samples_per_s", "samples_per_s_min", "samples_per_s_max",
    "one_process_samples_per_s", "one_process_samples_per_s_min", "one_process_samples_per_s_max",
    "efficiency", "efficiency_min", "efficiency_max", "vs_1f1b", "vs_1f1b_min", "vs_1f1b_max",
    "ideal_efficiency", "ideal_efficiency_min", "ideal_efficiency_max", "ideal_1f1b_bubble_efficiency",
    *(f"{k}{s}" for k in SHARES for s in ("", "_min", "_max")), "idle", "idle_min", "idle_max",
    "compute_inflation", "compute_inflation_min", "compute_inflation_max",
    *(f"{cat}_share" for cat in BREAKDOWN),
    "activation_peak_mib_rank0", "activation_peak_mib_rank1",
]  # fmt: skip


# ------------------------------------------------------------------- its tables in docs/results.md


def schedules(rows: t.Rows) -> str:
    placement = {"1f1b": "2 stages", "interleaved_1f1b": "4, looped", "interleaved_zero_bubble": "4, looped",
                 "zbv": "4, V", "dualpipev": "4, V"}  # fmt: skip
    header = ["schedule", "stages", "repeats", "samples/s", "vs 1f1b", "schedule's ideal"]
    header += ["compute", "bubble", "comm wait", "other", "compute inflation", "activation MiB rank 0 / 1"]
    body = []
    for r in rows:
        vs = "1" if r["schedule"] == "1f1b" else t.timed_col(r, "vs_1f1b", 2, t.ratio_verdict(r, "vs_1f1b"))
        body.append(
            [
                r["schedule"],
                placement.get(r["schedule"], "?"),
                r["repeats"],
                t.timed_col(r, "samples_per_s", 1),
                vs,
            ]
            + [t.timed_col(r, "ideal_efficiency", 3)]
            + [t.fixed(r[k], 3) for k in ("compute", "bubble", "comm_wait", "other")]
            + [t.timed_col(r, "compute_inflation", 2)]
            + [f"{t.fixed(r['activation_peak_mib_rank0'], 1)} / {t.fixed(r['activation_peak_mib_rank1'], 1)}"]
        )
    f1b = next(r for r in rows if r["schedule"] == "1f1b")
    note = (
        f"\n\nm = {f1b['num_microbatches']}, p = {f1b['pipeline_size']}, batch {f1b['batch_size']}. The 1F1B "
        "efficiency (throughput over p x one process) is the bubble table's, above (its m = 8 row); here the "
        "schedules are compared with each other (vs 1f1b: throughput per repeat) and their steps taken "
        "apart. The next columns come from `PipelineTimeline` on two recorded steps per run (medians): "
        "shares of the ranks' step time spent computing (stage forward and backward), in the bubble the "
        "schedule itself forces (its ideal: the recorded compute replayed with free communication; "
        "schedule's ideal = compute / (compute + bubble), against the bubble-only "
        f"{t.fixed(f1b['ideal_1f1b_bubble_efficiency'], 3)} of 1F1B with equal stages), waiting on P2P "
        "beyond that, and everything else (loss function, log broadcast, gradient sync, optimizer step, "
        "P2P posts, "
        "Python between them). Compute inflation: the ranks' stage compute per step over one process's "
        "whole step (1.0 = the layers cost the same as pipeline stages as in one process). For 1f1b the "
        "measured spans (which also hold part of the bubble: the last rank waits out the drain in the log "
        f"broadcast) are: P2P waits {t.fixed(f1b['wait_share'], 3)}, the loss function "
        f"{t.fixed(f1b['loss_share'], 3)}, the log broadcast and gradient sync "
        f"{t.fixed(f1b['collective_share'], 3)}, the optimizer step {t.fixed(f1b['optimizer_share'], 3)}, "
        f"P2P posts {t.fixed(f1b['comm_share'], 3)} and untracked time {t.fixed(f1b['untracked_share'], 3)}. "
        "The shares are medians over recorded steps; how to read them: [Where the time goes: "
        "PipelineTimeline](timeline.md)."
    )
    return t.table(header, body) + note


RESULTS = t.Results(
    "schedules",
    t.Section(
        "Pipeline schedules side by side: where the step goes (timeline)",
        t.Table(
            schedules,
            (
                "samples_per_s",
                "vs_1f1b",
                "ideal_efficiency",
                "compute",
                "bubble",
                "comm_wait",
                "other",
                "compute_inflation",
                "activation_peak_mib_rank0",
            ),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__).parse_args(argv)
    h.record_machine("schedules", args.out_dir)
    h.quiet()
    cfg, bench = Config(), Bench(repeats=args.repeats)
    if args.quick:  # width 32, 2 blocks, 16 bytes x 8 samples; one step of each kind, one repeat
        cfg = Config(dim=32, depth=2, seq_len=16, batch_size=8, warmup=1)
        bench = Bench(warmup=1, steps=1, recorded=1, repeats=1, memory_steps=1)
    ranks = h.spawn(worker, P, cfg, bench, args.out_dir)
    rows = rows_of(cfg, ranks)
    h.write_csv(args.out_dir / "schedules.csv", rows, COLUMNS)
    plot(args.out_dir / "schedules.png", rows, bench.repeats, cfg)
    for r in rows:
        print(
            {
                k: r[k]
                for k in (
                    "schedule",
                    "samples_per_s",
                    "efficiency",
                    "ideal_efficiency",
                    *SHARES,
                    "compute_inflation",
                )
            }
        )


if __name__ == "__main__":
    main()
