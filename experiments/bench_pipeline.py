"""Throughput of PipelineStrategy on 2 CPU processes: its overhead, and the pipeline bubble.

(a) **Overhead.** The same 2-stage pipeline (same stage modules, same torch.distributed.pipelining
    schedule with ``scale_grads=False``, same AdamW, same data order) trained two ways in the same
    two processes: under ``Trainer(strategy=PipelineStrategy(...))``, and by a hand-written loop that
    drives ``PipelineStage`` + ``Schedule1F1B``/``ScheduleGPipe`` directly. The two alternate (hand
    first, then Trainer first, ...), ``--repeats`` times each; the result is the median of the
    per-repeat Trainer / hand ratios with their range. Both start from the same weights and see the
    same batches, so their losses must agree: the CSV shows the largest difference. Beside the
    throughput, the **fixed cost** each adds per step: the first stage's time outside
    ``schedule.step()`` (from the end of one step's schedule to the start of the next: the optimizer
    step, the data, and for the Trainer its loop, hooks, log replay and the strategy's Python), the
    median over the timed steps. On the first stage that time is on the critical path (the last stage
    has finished its part of the schedule earlier and waits for it), so it is what the Trainer's
    ratio loses.
(b) **Micro-batches.** Throughput under PipelineStrategy for num_microbatches in 1, 2, 4, 8, for
    gpipe and 1f1b, divided by p x the throughput of one process training the whole model with the
    same micro-batches (gradient accumulation), both processes busy at once, in the same repeat:
    that efficiency is compared with the ideal bubble efficiency m / (m + p - 1). The three run
    interleaved (the first one rotating), ``--sweep-repeats`` times. At m = 1 the one-process run also
    runs alone (the other process idle): its throughput with both busy over alone tells whether the two
    processes really ran in parallel on this machine.

The model is the byte-level LM of ``models.py`` in its ``nn.Sequential`` form (split into two stages
balanced by parameter count); its config, data and one-process run are in ``_charlm_bench.py``.
Writes ``pipeline_overhead.csv`` (one row per repeat), ``pipeline_microbatches.csv`` (medians and
ranges) and ``pipeline_microbatches.png``.

Usage::

    python experiments/bench_pipeline.py            # defaults: a few minutes on 2 cores
    python experiments/bench_pipeline.py --quick    # a smoke run
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

import _harness as h
import _tables as t
import torch
import torch.nn.functional as F
from _charlm_bench import Config, build_model, loader, measured, run_single
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleGPipe

from lightning_parallel import PipelineStrategy
from lightning_parallel.pipeline.runner import schedule_class

P = 2  # pipeline stages = processes
GOAL = 0.98  # the Trainer keeps at least this share of the hand loop's throughput (issue 14)


# ------------------------------------------------------------------------------------ the runs


@contextlib.contextmanager
def schedule_spans() -> Iterator[list[tuple[float, float]]]:
    """When each ``schedule.step()`` of torch's single-stage schedules began and ended, while inside.

    The same wrapper times the hand loop's schedule and the one PipelineStrategy drives; it is
    removed on exit.
    """
    spans: list[tuple[float, float]] = []
    original = PipelineScheduleSingle.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spans.append((began, time.perf_counter()))

    PipelineScheduleSingle.step = step  # type: ignore[method-assign]
    try:
        yield spans
    finally:
        PipelineScheduleSingle.step = original  # type: ignore[method-assign]


def run_trainer(
    cfg: Config, world: int, schedule: str, m: int, steps: int, spans: list | None = None
) -> dict[str, Any]:
    """Train under Trainer(strategy=PipelineStrategy(...)) for warm-up + timed steps."""
    clock = h.StepClock()
    strategy = PipelineStrategy(
        pipeline_size=world, num_microbatches=m, schedule=schedule, partition="parameters"
    )
    trainer = h.quiet_trainer(
        devices=world, strategy=strategy, max_steps=cfg.warmup + steps, limit_val_batches=0, callbacks=[clock]
    )
    trainer.fit(build_model(cfg), train_dataloaders=loader(cfg, steps))
    expected = build_model(cfg).stage_counts(world)
    got = [len(s.units) for s in strategy.plan.stages]
    if got != expected:
        raise RuntimeError(f"the strategy split the layers {got}, the hand loop {expected}: not the same")
    return measured(clock, cfg, spans)


def _hand_schedule(cfg: Config, rank: int, world: int, schedule: str, m: int) -> tuple[Any, nn.Module]:
    model = build_model(cfg)
    counts = model.stage_counts(world)
    first = sum(counts[:rank])
    stage_module = nn.Sequential(*list(model.layers)[first : first + counts[rank]])
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    cls = schedule_class(schedule) if m >= world else ScheduleGPipe  # as PipelineStrategy falls back

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten()) / m

    return cls(stage, m, loss_fn=loss_fn, scale_grads=False), stage_module


def run_hand_loop(
    cfg: Config, rank: int, world: int, schedule: str, m: int, spans: list | None = None
) -> dict[str, Any]:
    """The same stages and schedule driven by hand: PipelineStage + a torch schedule + AdamW."""
    sched, stage_module = _hand_schedule(cfg, rank, world, schedule, m)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=cfg.lr, weight_decay=0.01)
    clock = h.StepClock()
    for step, (x, y) in enumerate(loader(cfg, cfg.steps)):
        if step == cfg.warmup + cfg.steps:
            break
        clock.starts.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            # The losses are all the loop needs: no merged outputs, as PipelineStrategy's training steps.
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step()
        optimizer.step()
        clock.ends.append(time.perf_counter())
        clock.losses.append(float(sum(losses)) if losses else float("nan"))
    return measured(clock, cfg, spans)


# ------------------------------------------------------------------------------- the worker side


def overhead_worker(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    """(a) on every rank: hand loop and Trainer, interleaved; this rank's samples."""
    s, m = cfg.overhead_schedule, cfg.overhead_microbatches

    def timed(run: Any) -> dict[str, Any]:
        with schedule_spans() as spans:
            return run(spans)

    variants = {
        "hand": lambda: timed(lambda spans: run_hand_loop(cfg, rank, world, s, m, spans)),
        "trainer": lambda: timed(lambda spans: run_trainer(cfg, world, s, m, cfg.steps, spans)),
    }
    return h.interleave(variants, cfg.repeats, before_each=h.barrier)


def _alone(cfg: Config, rank: int) -> dict[str, Any]:
    """The one-process run on rank 0 while the other ranks wait: is the machine really parallel?"""
    result = run_single(cfg, 1, cfg.sweep_steps) if rank == 0 else {}
    h.barrier()
    return result


def sweep_worker(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    """(b) on every rank: per m, one process / gpipe / 1f1b interleaved (and alone, at m = 1)."""
    samples = []
    for m in cfg.microbatches:
        variants = {"single": lambda m=m: run_single(cfg, m, cfg.sweep_steps)}
        for s in cfg.schedules:
            variants[s] = lambda m=m, s=s: run_trainer(cfg, world, s, m, cfg.sweep_steps)
        if m == 1:
            variants["single_alone"] = lambda: _alone(cfg, rank)
        samples += [dict(x, m=m) for x in h.interleave(variants, cfg.sweep_repeats, before_each=h.barrier)]
    return samples


# ------------------------------------------------------------------------------ results, on disk


def overhead_rows(cfg: Config, first: list[dict], last: list[dict]) -> list[dict[str, Any]]:
    """One row per repeat: hand vs Trainer samples/s (rank 0's clock), their ratio, loss agreement."""
    rows = []
    for rep in range(cfg.repeats):
        hand, trainer = (
            {x["variant"]: x for x in first if x["repeat"] == rep}[v] for v in ("hand", "trainer")
        )
        losses = {x["variant"]: x["losses"] for x in last if x["repeat"] == rep}
        diff = max(abs(a - b) for a, b in zip(losses["hand"], losses["trainer"]))
        rows.append(
            dict(
                repeat=rep,
                first="hand" if hand["position"] == 0 else "trainer",
                schedule=cfg.overhead_schedule,
                num_microbatches=cfg.overhead_microbatches,
                batch_size=cfg.batch_size,
                timed_steps=cfg.steps,
                hand_samples_per_s=round(hand["samples_per_s"], 2),
                trainer_samples_per_s=round(trainer["samples_per_s"], 2),
                ratio=round(trainer["samples_per_s"] / hand["samples_per_s"], 4),
                hand_fast_samples_per_s=round(hand["fast_samples_per_s"], 2),
                trainer_fast_samples_per_s=round(trainer["fast_samples_per_s"], 2),
                fast_ratio=round(trainer["fast_samples_per_s"] / hand["fast_samples_per_s"], 4),
                hand_step_ms_median=round(hand["step_ms"], 2),
                trainer_step_ms_median=round(trainer["step_ms"], 2),
                hand_outside_ms=round(hand["outside_ms"], 3),
                trainer_outside_ms=round(trainer["outside_ms"], 3),
                added_ms=round(trainer["outside_ms"] - hand["outside_ms"], 3),
                max_loss_diff=f"{diff:.2e}",
                goal=GOAL,
            )
        )
    return rows


def _per_repeat(ranks: list[list[dict]]) -> list[dict[str, Any]]:
    """Rank 0's samples; for "single" (every process trains a whole model) the mean over the ranks."""
    out = []
    for i, x in enumerate(ranks[0]):
        if x["variant"] == "single":
            both = [r[i] for r in ranks]
            x = dict(
                x, **{k: sum(b[k] for b in both) / len(both) for k in ("samples_per_s", "fast_samples_per_s")}
            )
        out.append(x)
    return out


EFFICIENCIES = (  # column, m of the one-process run (None: the same m), throughput column
    ("efficiency", None, "samples_per_s"),
    ("fast_efficiency", None, "fast_samples_per_s"),
    ("efficiency_vs_full_batch", 1, "samples_per_s"),
)


def sweep_rows(cfg: Config, ranks: list[list[dict]]) -> list[dict[str, Any]]:
    """One row per (kind, schedule, m): medians and ranges over the repeats of samples/s, and of the
    per-repeat efficiency against p x one process with the same micro-batches, beside the ideal."""
    samples = _per_repeat(ranks)
    at = {(x["m"], x["repeat"], x["variant"]): x for x in samples}
    rows = []
    for m, variant in dict.fromkeys((x["m"], x["variant"]) for x in samples):
        mine = [x for x in samples if (x["m"], x["variant"]) == (m, variant)]
        pipeline = variant in cfg.schedules
        row = dict(
            kind="pipeline" if pipeline else variant,
            schedule=variant if pipeline else "-",
            num_microbatches=m,
            batch_size=cfg.batch_size,
            repeats=len(mine),
        )
        row |= h.spread(x["samples_per_s"] for x in mine).cells("samples_per_s", 2)
        row["fast_samples_per_s"] = round(h.spread(x["fast_samples_per_s"] for x in mine).median, 2)
        # Efficiency against p x one process in the same repeat: with the same micro-batches, with
        # the fast steps only, and with the whole batch at once (m = 1).
        for key, m_single, sps in EFFICIENCIES if pipeline else ():
            one = {x["repeat"]: at[(m_single or m, x["repeat"], "single")][sps] for x in mine}
            row |= h.spread(x[sps] / (P * one[x["repeat"]]) for x in mine).cells(key, 4)
        row["ideal_bubble_efficiency"] = round(m / (m + P - 1), 4)
        rows.append(row)
    return rows


COLUMNS_SWEEP = [
    "kind", "schedule", "num_microbatches", "batch_size", "repeats",
    "samples_per_s", "samples_per_s_min", "samples_per_s_max", "fast_samples_per_s",
    "efficiency", "efficiency_min", "efficiency_max", "fast_efficiency", "fast_efficiency_min",
    "fast_efficiency_max", "efficiency_vs_full_batch", "efficiency_vs_full_batch_min",
    "efficiency_vs_full_batch_max", "ideal_bubble_efficiency",
]  # fmt: skip


def parallelism(samples: list[dict[str, Any]]) -> h.Spread:
    """Per repeat: one process's throughput with both busy over the same run alone (1.0 = parallel)."""
    at = {(x["repeat"], x["variant"]): x["samples_per_s"] for x in samples if x["m"] == 1}
    reps = sorted({r for r, _ in at})
    return h.spread(at[(r, "single")] / at[(r, "single_alone")] for r in reps)


def plot(path: Any, cfg: Config, rows: list[dict[str, Any]], par: h.Spread) -> None:
    ms = cfg.microbatches
    fig, (left, right) = h.figure(2)
    pick = {(r["kind"], r["schedule"], r["num_microbatches"]): r for r in rows}
    for s, marker in zip(cfg.schedules, "os^"):
        sel = [pick[("pipeline", s, m)] for m in ms]
        h.errorbars(left, ms, sel, "samples_per_s", marker=marker, label=f"{s}, p={P}")
        h.errorbars(right, ms, sel, "efficiency", marker=marker, label=f"{s}, p={P}")
    single = [pick[("single", "-", m)] for m in ms]
    left.plot(
        ms, [P * r["samples_per_s"] for r in single], "k--", label=f"{P} x one process (same micro-batches)"
    )
    h.errorbars(left, ms, single, "samples_per_s", fmt="k:", label="one process, whole model")
    dense = [2 ** (k / 8) for k in range(8 * int(math.log2(max(ms))) + 1)]  # 1 .. max(m)
    right.plot(dense, [m / (m + P - 1) for m in dense], "k--", label="ideal m / (m + p - 1)")
    left.set(ylabel="throughput (samples/s)", title="Throughput under PipelineStrategy")
    right.set(
        ylabel=f"efficiency (throughput / ({P} x one process))",
        title="Pipeline efficiency vs the ideal bubble",
        ylim=(0, 1.05),
    )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches per batch, m (count)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"CharLM dim={cfg.dim} depth={cfg.depth}, batch {cfg.batch_size}x{cfg.seq_len} bytes, "
        f"2 CPU processes (gloo); medians of {cfg.sweep_repeats} interleaved repeats, bars: min-max; "
        f"parallelism of the 2 processes {par.median:.2f} (1.0 = fully parallel)",
        fontsize=8,
    )
    h.save_figure(fig, path)


# ------------------------------------------------------------------------------------------ main


def make_config(argv: list[str] | None = None) -> tuple[Config, Any]:
    p = h.parser(__doc__, repeats=Config.repeats)
    p.add_argument("--dim", type=int, help="model width (default 128)")
    p.add_argument("--depth", type=int, help="transformer blocks (default 4)")
    p.add_argument("--batch-size", type=int, help="samples per step (default 32; a multiple of 16)")
    p.add_argument("--steps", type=int, help="timed steps per run in (a), after warm-up (default 12)")
    p.add_argument("--sweep-steps", type=int, help="timed steps per run in (b) (default 8)")
    p.add_argument("--sweep-repeats", type=int, help="interleaved repeats of (b) (default 5)")
    args = p.parse_args(argv)
    cfg = Config(repeats=args.repeats)
    if args.quick:
        cfg = replace(cfg, dim=64, depth=2, seq_len=32, batch_size=16, warmup=2, steps=4, sweep_steps=3)
        cfg = replace(cfg, sweep_repeats=1, microbatches=[1, 4, 16])
    for name in ("dim", "depth", "batch_size", "steps", "sweep_steps", "sweep_repeats"):
        if getattr(args, name) is not None:
            cfg = replace(cfg, **{name: getattr(args, name)})
    if cfg.batch_size % max(cfg.microbatches):
        p.error(f"--batch-size ({cfg.batch_size}) must be a multiple of {max(cfg.microbatches)}")
    return cfg, args


def report(cfg: Config, over: list[dict[str, Any]], sweep: list[dict[str, Any]], par: h.Spread) -> None:
    ratio = h.spread(r["ratio"] for r in over)
    print(
        f"(a) overhead, {cfg.overhead_schedule} m={cfg.overhead_microbatches}, {cfg.repeats} interleaved "
        f"repeats: Trainer / hand {ratio.median:.3f} ({ratio.lo:.3f} .. {ratio.hi:.3f}), goal >= {GOAL}: "
        f"{h.verdict(ratio.lo, ratio.hi, goal=GOAL)}"
    )
    for r in sweep:
        if r["kind"] == "pipeline":
            print(
                f"(b) {r['schedule']:>5} m={r['num_microbatches']:>2}: {r['samples_per_s']:7.1f} samples/s, "
                f"efficiency {r['efficiency']:.3f} ({r['efficiency_min']:.3f} .. {r['efficiency_max']:.3f}), "
                f"ideal {r['ideal_bubble_efficiency']:.3f}"
            )
    verdict = (
        "the two processes ran in parallel, so the curve shape is meaningful"
        if par.median >= 0.85
        else "the two processes did NOT get a core each (other load on the machine): the efficiencies "
        "are pessimistic and the curve shape only indicative"
    )
    print(f"parallelism {par.median:.2f} ({par.lo:.2f} .. {par.hi:.2f}): {verdict}")


# ------------------------------------------------------------------- its tables in docs/results.md


def pipeline_overhead(rows: t.Rows) -> str:
    r0, goal = rows[0], float(rows[0]["goal"])
    ratios = h.spread(float(r["ratio"]) for r in rows)
    worst = max(rows, key=lambda r: float(r["max_loss_diff"]))["max_loss_diff"]
    cells = [r0["schedule"], r0["num_microbatches"], r0["batch_size"], len(rows)]
    cells += [t.timed_rows(rows, k, 1) for k in ("hand_samples_per_s", "trainer_samples_per_s")]
    cells += [t.timed_rows(rows, "ratio", 2, h.verdict(ratios.lo, ratios.hi, goal=goal))]
    cells += [t.timed_rows(rows, "fast_ratio", 2)]
    header = ["schedule", "micro-batches", "batch", "repeats", "hand samples/s", "Trainer samples/s"]
    header += [f"Trainer / hand (goal {r0['goal']})", "Trainer / hand, fastest steps"]
    note = "\n\nMedians over the repeats, (min .. max) beside them; the ratio is taken within each repeat."
    if "added_ms" in r0:  # the fixed cost per step: the first stage's time outside the schedule
        cells += [t.timed_rows(rows, k, 2) for k in ("hand_outside_ms", "trainer_outside_ms", "added_ms")]
        header += ["first stage outside the schedule, hand ms", "... Trainer ms", "Trainer adds ms per step"]
        note += (
            " Outside the schedule: the first stage's median time per step from the end of one "
            "`schedule.step()` to the start of the next (the optimizer step and the data in both; "
            "Lightning's loop, its hooks, the log replay and the strategy's Python in the Trainer's); it is "
            "on the critical path, since the last stage has finished its part of the schedule earlier and "
            "waits."
        )
    return t.table([*header, "max loss diff"], [[*cells, worst]]) + note


def pipeline_microbatches(rows: t.Rows) -> str:
    at = {(r["kind"], r["schedule"], r["num_microbatches"]): r for r in rows}
    ms = sorted({r["num_microbatches"] for r in rows if r["kind"] == "pipeline"}, key=int)
    body = []
    for m in ms:
        gpipe, f1b = at[("pipeline", "gpipe", m)], at[("pipeline", "1f1b", m)]
        body.append(
            [m, f1b["repeats"], t.fixed(f1b["ideal_bubble_efficiency"], 3)]
            + [t.timed_col(x, "efficiency", 3) for x in (f1b, gpipe)]
            + [t.timed_col(x, "samples_per_s", 1) for x in (f1b, gpipe, at[("single", "-", m)])]
        )
    header = ["micro-batches m", "repeats", "ideal (bubble only)", "1f1b efficiency", "gpipe efficiency"]
    header += ["1f1b samples/s", "gpipe samples/s", "one process samples/s"]
    alone = at[("single_alone", "-", "1")]
    note = (
        f"\n\nEfficiency: pipeline throughput over p x one process with the same micro-batches, in the "
        f"same repeat. Parallelism of the two processes (one process's throughput with both busy over "
        f"alone; near one when each really has a core): {t.timed_col(alone, 'parallelism', 2)}."
    )
    return t.table(header, body) + note


RESULTS = t.Results(
    "pipeline",
    t.Section(
        "Pipeline overhead: the Trainer against a hand-driven schedule",
        t.Table(
            pipeline_overhead,
            ("hand_samples_per_s", "trainer_samples_per_s", "ratio", "fast_ratio"),
            timed=True,
        ),
    ),
    t.Section(
        "Pipeline bubble against the number of micro-batches",
        t.Table(
            pipeline_microbatches,
            (
                "samples_per_s",
                "samples_per_s_min",
                "samples_per_s_max",
                "efficiency",
                "efficiency_min",
                "efficiency_max",
                "ideal_bubble_efficiency",
                "parallelism",
            ),
            timed=True,
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    cfg, args = make_config(argv)
    h.record_machine("pipeline", args.out_dir)
    print(f"config: {asdict(cfg)}", flush=True)
    start = time.perf_counter()
    over_ranks = h.spawn(overhead_worker, P, cfg)
    over = overhead_rows(cfg, over_ranks[0], over_ranks[-1])
    h.write_csv(args.out_dir / "pipeline_overhead.csv", over)
    sweep_ranks = h.spawn(sweep_worker, P, cfg)
    sweep = sweep_rows(cfg, sweep_ranks)
    par = parallelism(_per_repeat(sweep_ranks))
    for r in sweep:
        r |= par.cells("parallelism", 4) if r["kind"] == "single_alone" else {}
    h.write_csv(
        args.out_dir / "pipeline_microbatches.csv",
        sweep,
        [*COLUMNS_SWEEP, "parallelism", "parallelism_min", "parallelism_max"],
    )
    plot(args.out_dir / "pipeline_microbatches.png", cfg, sweep, par)
    report(cfg, over, sweep, par)
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
