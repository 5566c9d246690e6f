"""Scaling run of the main job: 1 process against 2 processes (DDP, and PipelineStrategy with 2 stages).

Runs ``experiments/train_charlm.py`` (the byte-level transformer LM on the stdlib's sources) three
times as a subprocess, with the same global batch and the same number of optimizer steps, so every run
trains on the same number of samples:

* ``1 process``: ``--devices 1 --strategy auto``;
* ``2 x DDP``: ``--devices 2 --strategy ddp`` (2 replicas, half the global batch each);
* ``2 x pipeline``: ``--devices 2 --strategy pipeline --stages 2`` (one replica, 2 stages, micro-batches).

Each run validates once, at its last step (20 batches, the same samples in every run), and saves one
checkpoint. From each run's closing summary it records samples per second (over the whole fit, that
validation pass and checkpoint included), the final train loss (AllReducedMetrics' mean over the last
logging window) and the validation loss; the ratio is against the 1-process run of the same invocation.
Each process runs with ``OMP_NUM_THREADS=1`` (``--threads``), as ``make`` sets it: on this shared 2-core
machine one process with 2 intra-op threads measured 5-12x *slower* than with 1 (the threads spin
against the other jobs' processes), so ``--threads auto`` (cores // processes) is for a quiet machine.
The runs differ in data order (Lightning's DistributedSampler for 2 replicas, the loader's own shuffle
for one), so their losses agree only up to that noise.

A process with one thread stands for one device, so 2 processes can at best double the rate
of 1 (the dashed line in the plot). They fall short by what they pay for gloo gradient all-reduces (DDP)
or for the pipeline's bubble and activation sends, and, on this 2-core machine shared with other jobs,
by the cores they do not get: the ratio moves with the load (recorded by run_all.py in machine.csv).
On GPUs the same comparison measures scaling across devices.

Writes ``experiments/results/scaling_charlm.csv`` (one row per run), ``scaling_charlm_curves.csv``
(train loss against samples seen) and ``scaling_charlm.png``.

Usage::

    python experiments/scaling_charlm.py                 # defaults: 1-3 minutes on 2 cores
    python experiments/scaling_charlm.py --max-steps 20 --runs single ddp
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TRAIN = HERE / "train_charlm.py"


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

_SUMMARY = {
    "steps": r"optimizer steps\s+(\d+) x (\d+) samples",
    "train_loss": r"final train loss\s+(\S+)",
    "val_loss": r"final val loss\s+(\S+)",
    "samples_per_s": r"samples per second\s+(\S+)",
    "log": r"CSV log\s+(.+)",
}


# Lightning's progress bar redraws with carriage returns: each redraw arrives as a line; skip them.
_PROGRESS = re.compile(r"^\s*(\x1b\[A)?\s*(Epoch \d|Validation DataLoader|Sanity Checking|\x1b\[A)")


def parse_summary(text: str) -> dict:
    """The numbers of train_charlm.py's closing ``=== run summary ===`` block.

    Raises:
        ValueError: a field is missing (the summary format changed, or the run did not finish).
    """
    found = {key: re.search(pattern, text) for key, pattern in _SUMMARY.items()}
    missing = [key for key, m in found.items() if m is None]
    if missing:
        raise ValueError(
            f"train_charlm.py's summary lacks {missing}: did the run finish? "
            "Update _SUMMARY in scaling_charlm.py if the summary format changed."
        )
    return {
        "optimizer_steps": int(found["steps"].group(1)),
        "global_batch_size": int(found["steps"].group(2)),
        "train_loss": float(found["train_loss"].group(1)),
        "val_loss": float(found["val_loss"].group(1)),
        "samples_per_s": float(found["samples_per_s"].group(1)),
        "log": found["log"].group(1).strip(),
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
        f"--seed={args.seed}",
        f"--out={out}",
    ]


def threads_for(run: Run, threads: str) -> int:
    if threads == "auto":
        return max(1, (os.cpu_count() or 1) // run.processes)
    return int(threads)


def execute(run: Run, args: argparse.Namespace, workdir: Path) -> dict:
    """Run train_charlm.py once, streaming its output, and return its summary plus the parent's wall time."""
    threads = threads_for(run, args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = command(run, args, workdir / run.name)
    print(f"\n--- {run.label}: {' '.join(cmd[1:])} (OMP_NUM_THREADS={threads})", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() and not _PROGRESS.match(line):
            print(f"  [{run.name}] {line}", end="", flush=True)
    if proc.wait():
        raise SystemExit(f"{run.label} failed (exit {proc.returncode}): {' '.join(cmd)}")
    summary = parse_summary("".join(lines))
    if summary["optimizer_steps"] != args.max_steps:
        raise SystemExit(
            f"{run.label} made {summary['optimizer_steps']} steps, not --max-steps {args.max_steps}"
        )
    summary.update(run=run.label, processes=run.processes, strategy=run.strategy, threads_per_process=threads)
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary


def train_curve(log: str, label: str, global_batch: int) -> list[dict]:
    """Train loss against samples seen, from the run's CSVLogger file."""
    with open(log, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    return [
        {"run": label, "step": int(r["step"]), "samples": (int(r["step"]) + 1) * global_batch}
        | {"train_loss": round(float(r["train_loss"]), 4)}
        for r in rows
    ]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, rows: list[dict], curves: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["run"] for r in rows]
    x = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.4))
    rates = [float(r["samples_per_s"]) for r in rows]
    bars = a.bar(x, rates, color="tab:blue", label="measured")
    a.bar_label(bars, [f"{float(r['ratio_vs_1_process']):.2f}x" for r in rows])
    ideal = [rates[0] * int(r["processes"]) for r in rows]
    a.hlines(
        ideal, [i - 0.4 for i in x], [i + 0.4 for i in x], "k", "--", label="ideal: processes x 1 process"
    )
    a.set_ylim(0, 1.3 * max(ideal))
    a.set_ylabel("samples / s (whole fit)")
    a.set_title("throughput (label: ratio vs 1 process)")
    a.legend(loc="upper left", ncols=2)
    b.bar([i - 0.2 for i in x], [float(r["train_loss"]) for r in rows], 0.4, label="final train loss")
    b.bar([i + 0.2 for i in x], [float(r["val_loss"]) for r in rows], 0.4, label="val loss")
    b.set_ylim(0, 1.25 * max(float(r["val_loss"]) for r in rows))
    b.set_ylabel("cross-entropy (nats / byte)")
    b.set_title(f"loss after the same {rows[0]['samples']} samples")
    b.legend(loc="upper center", ncols=2)
    for label, style in zip(labels, ("o-", "s--", "^:")):
        sel = [p for p in curves if p["run"] == label]
        c.plot([int(p["samples"]) for p in sel], [float(p["train_loss"]) for p in sel], style, label=label)
    c.set_xlabel("samples seen")
    c.set_ylabel("train loss (nats / byte)")
    c.set_title("train loss, same global batch")
    c.legend()
    for ax in (a, b):
        ax.set_xticks(list(x), labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="runs (default all)")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps per run (default 60)")
    p.add_argument(
        "--global-batch-size", type=int, default=32, help="samples per optimizer step (default 32)"
    )
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (default 4)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        default="1",
        help="OMP_NUM_THREADS per process (default 1: a process is a device); auto = cores // processes",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "scaling_charlm", help="output path stem")
    p.add_argument(
        "--plot-only", action="store_true", help="redraw the PNG from the existing CSVs, run nothing"
    )
    args = p.parse_args(argv)
    if "single" not in args.runs:
        p.error("--runs must include 'single': the ratios are against the 1-process run")
    if args.threads != "auto" and not args.threads.isdigit():
        p.error(f"--threads ({args.threads}) must be 'auto' or a positive integer")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    curves_path = args.out.parent / f"{args.out.name}_curves.csv"
    if args.plot_only:
        plot(args.out.with_suffix(".png"), read_csv(args.out.with_suffix(".csv")), read_csv(curves_path))
        return
    runs = [RUNS[name] for name in RUNS if name in args.runs]
    with tempfile.TemporaryDirectory(prefix="scaling-charlm-") as tmp:
        results = [execute(run, args, Path(tmp)) for run in runs]
        curves = [p for r in results for p in train_curve(r.pop("log"), r["run"], r["global_batch_size"])]
    base = results[0]["samples_per_s"]
    rows = [
        {
            "run": r["run"],
            "processes": r["processes"],
            "strategy": r["strategy"],
            "threads_per_process": r["threads_per_process"],
            "global_batch_size": r["global_batch_size"],
            "optimizer_steps": r["optimizer_steps"],
            "samples": r["optimizer_steps"] * r["global_batch_size"],
            "samples_per_s": r["samples_per_s"],
            "ratio_vs_1_process": round(r["samples_per_s"] / base, 3),
            "train_loss": r["train_loss"],
            "val_loss": r["val_loss"],
            "wall_s": r["wall_s"],
        }
        for r in results
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out.with_suffix(".csv"), rows)
    write_csv(curves_path, curves)
    plot(args.out.with_suffix(".png"), rows, curves)
    print(f"\n{'run':<26}{'samples/s':>10}{'vs 1 proc':>10}{'train':>8}{'val':>8}")
    for r in rows:
        print(
            f"{r['run']:<26}{r['samples_per_s']:>10.1f}{r['ratio_vs_1_process']:>9.2f}x"
            f"{r['train_loss']:>8.3f}{r['val_loss']:>8.3f}"
        )
    best = max(rows[1:], key=lambda r: r["ratio_vs_1_process"], default=None)
    if best is not None:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"\nBest 2-process run: {best['run']}, {best['ratio_vs_1_process']:.2f}x the 1-process rate "
            f"(ideal 2x). Load average now {load} on {os.cpu_count()} cores: on a shared machine the "
            "2-process runs compete with other jobs for the cores, and the ratio moves with the load."
        )
    print(f"wrote {args.out.with_suffix('.csv')}, {args.out.name}_curves.csv and .png")


if __name__ == "__main__":
    main()
