"""What HangWatchdog costs: the main job's step time with and without it, and the cost of one tracked call.

* **Step time.** The main job's model (``models.CharLM``, a GPT pipelined over 2 processes with
  ``PipelineStrategy``) trains with and without ``HangWatchdog(timeout=300)``, interleaved in the same two
  processes; the ratio of the median step times within each repeat, with its range (goal: at most 1.01).
* **Per call.** The same processes time an ``all_reduce`` of one number over a group of one rank (no
  waiting on the other process) with the watchdog's tracking of ``torch.distributed`` installed and
  without, interleaved: the microseconds one tracked collective adds, a number that does not depend on
  the training step's noise.

Writes ``watchdog.csv``, ``watchdog_calls.csv`` and ``watchdog.png``.

Usage::

    python experiments/bench_watchdog.py            # a few minutes on 2 cores
    python experiments/bench_watchdog.py --quick    # a smoke run
"""

from __future__ import annotations

import time
from typing import Any

import _harness as h
import _tables as t
import torch
import torch.distributed as dist
from models import ByteWindows, CharLM
from torch.utils.data import DataLoader

from lightning_parallel import HangWatchdog, PipelineStrategy
from lightning_parallel.distributed.watchdog_state import RankActivity, install_tracking, uninstall_tracking

GOAL = 1.01  # the watchdog adds at most 1% to the step time


def timed_fit(watchdog: bool, world: int, args: dict[str, Any]) -> dict[str, float]:
    torch.manual_seed(0)
    model = CharLM(dim=args["dim"], depth=args["depth"], seq_len=args["seq_len"])
    data = ByteWindows.of_stdlib((args["warmup"] + args["steps"] + 2) * args["batch_size"], args["seq_len"])
    clock = h.StepClock()
    callbacks: list[Any] = [clock] + ([HangWatchdog(timeout=300)] if watchdog else [])
    trainer = h.quiet_trainer(
        devices=world,
        strategy=PipelineStrategy(pipeline_size=world, num_microbatches=4),
        max_steps=args["warmup"] + args["steps"],
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(data, batch_size=args["batch_size"], drop_last=True))
    return {"step_ms": clock.median_step_ms(args["warmup"])}


def timed_calls(tracked: bool, calls: int, alone: Any) -> dict[str, float]:
    """Microseconds per all_reduce of one number on a one-rank group, tracked by the watchdog or not."""
    if tracked:
        install_tracking(RankActivity())
    try:
        t = torch.zeros(1)
        h.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t, group=alone)
        return {"call_us": 1e6 * (time.perf_counter() - start) / calls}
    finally:
        if tracked:
            uninstall_tracking()


def worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    fits = {"off": lambda: timed_fit(False, world, args), "on": lambda: timed_fit(True, world, args)}
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    calls = {
        name: (lambda on=on: timed_calls(on, args["calls"], alone))
        for name, on in (("off", False), ("on", True))
    }
    return {
        "fits": h.interleave(fits, repeats=args["repeats"], before_each=h.barrier),
        "calls": h.interleave(calls, repeats=max(args["repeats"], 10), before_each=h.barrier, warmup=True),
    }


# ------------------------------------------------------------------- its tables in docs/results.md


def watchdog(rows: t.Rows) -> str:
    by = {r["variant"]: r for r in rows}
    off, on, goal = by["off"], by["on"], float(rows[0]["goal"])
    verdict = t.ratio_verdict(on, "ratio", goal=goal, higher_is_better=False)
    header = ["repeats", "step ms, no watchdog", "step ms, HangWatchdog", f"with / without (goal <= {goal})"]
    cells = [on["repeats"], t.timed_col(off, "step_ms", 1), t.timed_col(on, "step_ms", 1)]
    return t.table(header, [[*cells, t.timed_col(on, "ratio", 3, verdict)]]) + (
        "\n\nThe main job (GPT, 2 pipeline stages); the ratio is taken within each repeat."
    )


def watchdog_calls(rows: t.Rows) -> str:
    by = {r["variant"]: r for r in rows}
    off, on = by["off"], by["on"]
    header = ["repeats", "all_reduce µs, untracked", "all_reduce µs, tracked", "added µs per call"]
    cells = [
        on["repeats"],
        t.timed_col(off, "call_us", 1),
        t.timed_col(on, "call_us", 1),
        t.timed_col(on, "added_us", 2),
    ]
    return (
        t.table(header, [cells])
        + "\n\nOne number all-reduced over a one-rank gloo group (no waiting on the peer), "
        "thousands of calls per repeat."
    )


RESULTS = t.Results(
    "watchdog",
    t.Section(
        "HangWatchdog: what it costs",
        t.Table(watchdog, ("step_ms", "ratio")),
        t.Table(watchdog_calls, ("call_us", "added_us")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    h.add_model_args(p)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.steps, args.dim, args.calls = 1, 1, 2, 32, 100
        args.depth, args.seq_len, args.batch_size = 2, 16, 8
    h.quiet()
    h.record_machine("watchdog", args.out_dir)
    cfg = {k: v for k, v in vars(args).items() if k != "out_dir"}
    result = h.spawn(worker, 2, cfg)[0]
    fits = h.compare(result["fits"], "step_ms", baseline="off")
    calls = h.compare(result["calls"], "call_us", baseline="off")
    added = h.spread(
        on - off
        for on, off in zip(
            [s["call_us"] for s in result["calls"] if s["variant"] == "on"],
            [s["call_us"] for s in result["calls"] if s["variant"] == "off"],
        )
    )
    for row in calls:
        row |= (
            added.cells("added_us", 2)
            if row["variant"] == "on"
            else {"added_us": 0, "added_us_min": 0, "added_us_max": 0}
        )
    for row in fits:
        row["goal"] = GOAL
    h.write_csv(args.out_dir / "watchdog.csv", fits)
    h.write_csv(args.out_dir / "watchdog_calls.csv", calls)
    fig, (left, right) = h.figure(ncols=2)
    h.errorbars(left, [r["variant"] for r in fits], fits, "step_ms", marker="o")
    left.set_title("main job step (ms), watchdog off / on")
    h.errorbars(right, [r["variant"] for r in calls], calls, "call_us", marker="o")
    right.set_title("one all_reduce on one rank (µs), tracking off / on")
    h.save_figure(fig, args.out_dir / "watchdog.png")
    for row in fits + calls:
        print(row)


if __name__ == "__main__":
    main()
