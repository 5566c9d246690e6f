"""Scaling run of the main job: 1 process against 2 processes (DDP, and PipelineStrategy with 2 stages).

Runs ``experiments/train_charlm.py`` (the byte-level transformer LM on the stdlib's sources) as a
subprocess, with the same global batch and the same number of optimizer steps, so every run trains on
the same number of samples:

* ``1 process``: ``--devices 1 --strategy auto``;
* ``2 x DDP``: ``--devices 2 --strategy ddp`` (2 replicas, half the global batch each);
* ``2 x pipeline``: ``--devices 2 --strategy pipeline --stages 2`` (one replica, 2 stages, micro-batches).

The three run interleaved (the first one rotating), ``--repeats`` times each. Each run validates once,
at its last step (20 batches, the same samples in every run), and saves one checkpoint. From each run's
JSON summary (``--summary`` of train_charlm.py; nothing is read from its printed output) it records
samples per second (over the whole fit, that validation pass and checkpoint included), the final
train loss (AllReducedMetrics' mean over the last logging window) and the validation loss; the ratio is
against the 1-process run of the same repeat, and the CSV holds the median and the range of each.
Each process runs with ``OMP_NUM_THREADS=1`` (``--threads``): on this shared 2-core machine one process
with 2 intra-op threads measured 5-12x *slower* than with 1 (the threads spin against the other jobs'
processes), so ``--threads auto`` (cores // processes) is for a quiet machine. The runs differ in data
order (Lightning's DistributedSampler for 2 replicas, the loader's own shuffle for one), so their losses
agree only up to that noise.

A process with one thread stands for one device, so 2 processes can at best double the rate of 1 (the
dashed line in the plot). They fall short by what they pay for gloo gradient all-reduces (DDP) or for
the pipeline's bubble and activation sends, and, on a 2-core machine shared with other jobs, by the
cores they do not get. On GPUs the same comparison measures scaling across devices.

Writes ``scaling_charlm.csv`` (one row per configuration), ``scaling_charlm_curves.csv`` (train loss
against samples seen, first repeat) and ``scaling_charlm.png``.

Usage::

    python experiments/scaling_charlm.py                 # defaults: a few minutes on 2 cores
    python experiments/scaling_charlm.py --max-steps 20 --runs single ddp --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as h
import _tables as t

TRAIN = Path(__file__).resolve().parent / "train_charlm.py"


@dataclass(frozen=True)
class Run:
    """One configuration of the main job: its label and train_charlm.py arguments."""

    name: str
    label: str
    processes: int
    strategy: str
    extra: tuple[str, ...] = ()


RUNS = {
    "single": Run("single", "1 process", 1, "auto"),
    "ddp": Run("ddp", "2 x DDP", 2, "ddp"),
    "pipeline": Run("pipeline", "2 x pipeline (2 stages)", 2, "pipeline", ("--stages", "2")),
}


def command(run: Run, args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable,
        str(TRAIN),
        f"--devices={run.processes}",
        f"--strategy={run.strategy}",
        *run.extra,
        f"--max-steps={args.max_steps}",
        f"--val-every={args.max_steps}",
        f"--global-batch-size={args.global_batch_size}",
        f"--microbatches={args.microbatches}",
        f"--dim={args.dim}",
        f"--depth={args.depth}",
        f"--seq-len={args.seq_len}",
        f"--lr={args.lr}",
        "--warmup-steps=0",  # what its recorded results ran with, whatever the demo's defaults become
        f"--seed={args.seed}",
        f"--out={out}",
        *([f"--text-bytes={args.text_bytes}"] if args.text_bytes else []),
        f"--summary={out / 'summary.json'}",
    ]


def threads_for(run: Run, threads: str) -> int:
    if threads == "auto":
        return max(1, (os.cpu_count() or 1) // run.processes)
    return int(threads)


def execute(run: Run, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run train_charlm.py once (its output to a log file) and return its JSON summary plus the
    wall time seen from here (start-up included)."""
    out = Path(tempfile.mkdtemp(prefix=f"{run.name}-", dir=workdir))
    threads = threads_for(run, args.threads)
    cmd = command(run, args, out)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if "STANDALONE_PORT" in env:  # a port of the harness's range, past those it has handed out, per run
        env["STANDALONE_PORT"] = str(h.free_port())
    with open(out / "output.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=log).returncode
    wall = time.perf_counter() - start
    if code:
        tail = (out / "output.log").read_text()[-3000:]
        raise SystemExit(f"{run.label} failed (exit {code}): {' '.join(cmd)}\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    if summary["optimizer_steps"] != args.max_steps:
        raise SystemExit(
            f"{run.label} made {summary['optimizer_steps']} steps, not --max-steps {args.max_steps}"
        )
    print(f"  {run.label:<26} {summary['samples_per_s']:7.1f} samples/s, wall {wall:5.1f} s", flush=True)
    return dict(
        {
            k: summary[k]
            for k in ("samples_per_s", "train_loss", "val_loss", "optimizer_steps", "global_batch_size")
        },
        wall_s=wall,
        threads_per_process=threads,
        log=summary["log_csv"],
    )


def train_curve(log: str, label: str, global_batch: int) -> list[dict[str, Any]]:
    """Train loss against samples seen, from the run's CSVLogger file."""
    rows = [r for r in h.read_csv(Path(log)) if r.get("train_loss")]
    return [
        {"run": label, "step": int(r["step"]), "samples": (int(r["step"]) + 1) * global_batch}
        | {"train_loss": round(float(r["train_loss"]), 4)}
        for r in rows
    ]


def result_rows(runs: list[Run], samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration: medians over the repeats, with ranges for the timings, and the
    median of the per-repeat ratios to the 1-process run."""
    compared = {
        r["variant"]: r for r in h.compare(samples, "samples_per_s", "single", "ratio_vs_1_process", 3)
    }
    rows = []
    for run in runs:
        mine = [s for s in samples if s["variant"] == run.name]
        c = compared[run.name]
        first = mine[0]
        rows.append(
            dict(run=run.label, processes=run.processes, strategy=run.strategy)
            | dict(
                threads_per_process=first["threads_per_process"], global_batch_size=first["global_batch_size"]
            )
            | dict(
                optimizer_steps=first["optimizer_steps"],
                samples=first["optimizer_steps"] * first["global_batch_size"],
            )
            | {k: c[k] for k in ("samples_per_s", "samples_per_s_min", "samples_per_s_max")}
            | {k: c[k] for k in ("ratio_vs_1_process", "ratio_vs_1_process_min", "ratio_vs_1_process_max")}
            | {k: round(h.spread(s[k] for s in mine).median, 4) for k in ("train_loss", "val_loss")}
            | h.spread(s["wall_s"] for s in mine).cells("wall_s", 1)
            | {"repeats": len(mine)}
        )
    return rows


def plot(path: Path, rows: list[dict[str, Any]], curves: list[dict[str, Any]]) -> None:
    labels = [r["run"] for r in rows]
    x = list(range(len(rows)))
    fig, (a, b, c) = h.figure(3, size=(15, 4.4))
    rates = [float(r["samples_per_s"]) for r in rows]
    h.errorbars(a, x, rows, "samples_per_s", fmt="o", color="tab:blue", label="measured (median, min-max)")
    for i, r in enumerate(rows):
        a.annotate(
            f"{float(r['ratio_vs_1_process']):.2f}x", (i, rates[i]), textcoords="offset points", xytext=(8, 4)
        )
    ideal = [rates[0] * int(r["processes"]) for r in rows]
    a.hlines(
        ideal, [i - 0.3 for i in x], [i + 0.3 for i in x], "k", "--", label="ideal: processes x 1 process"
    )
    a.set_ylim(0, 1.3 * max(ideal))
    a.set_ylabel("samples / s (whole fit)")
    a.set_title("throughput (label: median ratio vs 1 process)")
    a.legend(loc="upper left", fontsize=8)
    b.bar([i - 0.2 for i in x], [float(r["train_loss"]) for r in rows], 0.4, label="final train loss")
    b.bar([i + 0.2 for i in x], [float(r["val_loss"]) for r in rows], 0.4, label="val loss")
    b.set_ylim(0, 1.25 * max(float(r["val_loss"]) for r in rows))
    b.set_ylabel("cross-entropy (nats / byte)")
    b.set_title(f"loss after the same {rows[0]['samples']} samples")
    b.legend(loc="upper center", ncols=2)
    for label, style in zip(labels, ("o-", "s--", "^:")):
        sel = [p for p in curves if p["run"] == label]
        c.plot([int(p["samples"]) for p in sel], [float(p["train_loss"]) for p in sel], style, label=label)
    c.set(xlabel="samples seen", ylabel="train loss (nats / byte)", title="train loss, same global batch")
    c.legend()
    for ax in (a, b):
        ax.set_xticks(x, labels, fontsize=8)
    h.save_figure(fig, path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="runs (default all)")
    p.add_argument("--max-steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument(
        "--global-batch-size", type=int, default=32, help="samples per optimizer step (default 32)"
    )
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (default 4)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sample (default 64)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-bytes", type=int, help="bytes of stdlib source (default: train_charlm.py's)")
    p.add_argument(
        "--threads",
        default="1",
        help="OMP_NUM_THREADS per process (default 1: a process is a device); auto = cores // processes",
    )
    p.add_argument(
        "--plot-only", action="store_true", help="redraw the PNG from the existing CSVs, run nothing"
    )
    args = p.parse_args(argv)
    if "single" not in args.runs:
        p.error("--runs must include 'single': the ratios are against the 1-process run")
    if args.threads != "auto" and not args.threads.isdigit():
        p.error(f"--threads ({args.threads}) must be 'auto' or a positive integer")
    if args.quick:
        # 2 blocks: the pipeline run's 2 stages each need one; 10 steps: train_charlm.py logs every 10
        args.max_steps, args.dim, args.depth, args.repeats = 10, 32, 2, 1
        args.global_batch_size, args.seq_len, args.microbatches, args.text_bytes = 8, 16, 2, 40_000
    return args


# ------------------------------------------------------------------- its tables in docs/results.md


def scaling_charlm(rows: t.Rows) -> str:
    body = []
    for r in rows:
        single = r["processes"] == "1"
        verdict = "" if single else t.ratio_verdict(r, "ratio_vs_1_process", words=("faster", "slower"))
        body.append(
            [
                *(r[k] for k in ("run", "processes", "threads_per_process", "samples", "repeats")),
                t.timed_col(r, "samples_per_s", 1),
                "-" if single else t.timed_col(r, "ratio_vs_1_process", 2, verdict),
                *(t.fixed(r[k], 3) for k in ("train_loss", "val_loss")),
                t.timed_col(r, "wall_s", 1),
            ]
        )
    header = ["run", "processes", "threads each", "samples", "repeats", "samples/s", "vs one process"]
    return t.table([*header, "final train loss", "val loss", "wall s (incl. start-up)"], body)


RESULTS = t.Results(
    "scaling_charlm",
    t.Section(
        "Scaling the main job: one process against two",
        t.Table(
            scaling_charlm,
            (
                "samples_per_s",
                "samples_per_s_min",
                "ratio_vs_1_process",
                "ratio_vs_1_process_max",
                "train_loss",
                "val_loss",
                "wall_s",
                "wall_s_min",
            ),
            timed=True,
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out, curves_path = args.out_dir / "scaling_charlm.csv", args.out_dir / "scaling_charlm_curves.csv"
    if args.plot_only:
        plot(out.with_suffix(".png"), h.read_csv(out), h.read_csv(curves_path))
        return
    h.record_machine("scaling_charlm", args.out_dir)
    runs = [RUNS[name] for name in RUNS if name in args.runs]
    with tempfile.TemporaryDirectory(prefix="scaling-charlm-") as tmp:
        variants = {run.name: lambda run=run: execute(run, args, Path(tmp)) for run in runs}
        samples = h.interleave(variants, args.repeats)
        first = {s["variant"]: s for s in samples if s["repeat"] == 0}
        curves = [
            p
            for run in runs
            for p in train_curve(first[run.name]["log"], run.label, first[run.name]["global_batch_size"])
        ]
    rows = result_rows(runs, samples)
    h.write_csv(out, rows)
    h.write_csv(curves_path, curves)
    plot(out.with_suffix(".png"), rows, curves)
    for r in rows:
        verdict = h.verdict(
            r["ratio_vs_1_process_min"], r["ratio_vs_1_process_max"], words=("faster", "slower")
        )
        print(
            f"{r['run']:<26}{r['samples_per_s']:>8.1f} samples/s, {r['ratio_vs_1_process']:.2f}x "
            f"({r['ratio_vs_1_process_min']:.2f} .. {r['ratio_vs_1_process_max']:.2f}) vs 1 process"
            + ("" if r["processes"] == 1 else f": {verdict}")
        )
    print(f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
