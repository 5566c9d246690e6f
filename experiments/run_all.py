"""Run every experiment, then rebuild README.md's results block from the CSVs in experiments/results/.

Each script runs with its defaults, one after the other, as a subprocess whose output streams through;
the first failure stops everything, README untouched. Then the block between ``<!-- results:start -->``
and ``<!-- results:end -->`` in README.md is rewritten (nothing else in the file): a table per question,
the plots, and the machine each experiment ran on (recorded in ``results/machine.csv`` when it ran).
Every number in the block is read from a CSV, or is a median / maximum / count of a CSV column.

Usage::

    python experiments/run_all.py                        # everything (long: tens of minutes on 2 cores)
    python experiments/run_all.py --only scaling_charlm  # one experiment, then the whole block
    python experiments/run_all.py --skip-run             # only rebuild the block from the existing CSVs
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
MACHINE_FIELDS = ["experiment", "date", "load_avg_1min", "cpu_model", "cores", "python", "torch", "lightning"]

Rows = list[dict[str, str]]


# ------------------------------------------------------------------------ one table per CSV


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _f(value: str | float, digits: int) -> str:
    return f"{float(value):.{digits}f}"


def _median(rows: Rows, key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def _groups(rows: Rows, key: str) -> dict[str, Rows]:
    out: dict[str, Rows] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def _mib(value: float) -> str:
    return _f(value / 2**20, 1)


def pipeline_overhead(rows: Rows) -> str:
    r0, ratios = rows[0], [float(r["ratio"]) for r in rows]
    worst = max(rows, key=lambda r: float(r["max_loss_diff"]))["max_loss_diff"]
    cells = [r0["schedule"], r0["num_microbatches"], r0["batch_size"], len(rows)]
    cells += [_f(_median(rows, k), 1) for k in ("hand_samples_per_s", "trainer_samples_per_s")]
    cells += [_f(_median(rows, "ratio"), 2), f"{min(ratios):.2f} .. {max(ratios):.2f}"]
    cells += [_f(_median(rows, "fast_ratio"), 2), worst]
    header = ["schedule", "micro-batches", "batch", "repeats", "hand samples/s", "Trainer samples/s"]
    header += ["Trainer / hand", "per-repeat range", "Trainer / hand, fastest steps", "max loss diff"]
    return _table(header, [cells]) + "\n\nSamples/s and ratios: medians over the repeats."


def pipeline_microbatches(rows: Rows) -> str:
    at = {(r["kind"], r["schedule"], r["num_microbatches"]): r for r in rows}
    ms = sorted({r["num_microbatches"] for r in rows if r["kind"] == "pipeline"}, key=int)
    body = []
    for m in ms:
        gpipe, f1b = at[("pipeline", "gpipe", m)], at[("pipeline", "1f1b", m)]
        body.append(
            [m, _f(f1b["ideal_bubble_efficiency"], 3), _f(f1b["efficiency"], 3), _f(gpipe["efficiency"], 3)]
            + [_f(x["samples_per_s"], 1) for x in (f1b, gpipe, at[("single", "-", m)])]
        )
    header = ["micro-batches m", "ideal (bubble only)", "1f1b efficiency", "gpipe efficiency"]
    header += ["1f1b samples/s", "gpipe samples/s", "one process samples/s"]
    alone, busy = at[("single_alone", "-", "1")], at[("single", "-", "1")]
    note = (
        f"\n\nOne process alone: {_f(alone['samples_per_s'], 1)} samples/s; with both processes busy: "
        f"{_f(busy['samples_per_s'], 1)} samples/s each (equal when each process really has a core)."
    )
    return _table(header, body) + note


def pipeline_memory(rows: Rows) -> str:
    body = []
    for run, ranks in _groups(rows, "run").items():
        r0 = ranks[0]
        on_meta = all(r["other_stage_params"] == r["other_stage_params_meta"] for r in ranks)
        body.append(
            [
                run,
                r0["world_size"],
                f"{r0['model_dim']} x {r0['model_depth']}",
                _mib(max(float(r["ppo_bytes"]) for r in ranks)),
                _f(max(float(r["ppo_vs_ddp"]) for r in ranks), 3),
                " / ".join(_mib(float(r["activation_peak_bytes"])) for r in ranks),
                "yes" if r0["strategy"] == "pipeline" and on_meta else "-",
                _f(max(float(r["max_rss_mb"]) for r in ranks), 1),
            ]
        )
    header = ["run", "ranks", "width x blocks", "params+grads+AdamW MiB (worst rank)", "vs DDP"]
    header += ["activation peak MiB, rank by rank", "other stages stay on meta", "max RSS MB"]
    return _table(header, body)


def metric_sync(rows: Rows) -> str:
    at = {(r["k"], r["mode"]): r for r in rows}
    body = []
    for k in sorted({r["k"] for r in rows}, key=int):
        arm, sync = at[(k, "all_reduced_metrics")], at[(k, "sync_dist")]
        body.append(
            [
                k,
                _f(arm["collectives_per_step"], 0),
                _f(sync["collectives_per_step"], 0),
                _f(arm["no_sync_step_ms"], 1),
                _f(arm["step_ms"], 1),
                _f(sync["step_ms"], 1),
                _f(arm["overhead_ms"], 1),
                _f(sync["overhead_ms"], 1),
            ]
        )
    header = ["metrics K", "collectives/step AllReducedMetrics", "collectives/step sync_dist"]
    header += ["step ms, no sync", "step ms AllReducedMetrics", "step ms sync_dist"]
    return _table([*header, "overhead ms AllReducedMetrics", "overhead ms sync_dist"], body)


def checkpoint_bench(rows: Rows) -> str:
    body = [
        [method, len(saves)]
        + [_f(_median(saves, k), 2) for k in ("stall_s", "total_s")]
        + [_f(_median(saves, "extra_mib"), 1)]
        for method, saves in _groups(rows, "method").items()
    ]
    header = ["method", "saves", "training stall s (median)", "save done s (median)", "extra memory MiB"]
    return _table(header, body)


def checkpoint_kill(rows: Rows) -> str:
    body = [
        [
            r["method"],
            os.path.dirname(r["tmpdir"]),
            r["kills"],
            r["files_present"],
            r["files_loadable"],
            r["files_unloadable"],
            r["orphans"],
            _f(r["orphan_mib"], 1),
        ]
        for r in rows
    ]
    header = ["writer", "TMPDIR on", "kills", "files present", "loadable", "unloadable", "orphan temp files"]
    return _table([*header, "orphan MiB"], body)


def accumulation_equivalence(rows: Rows) -> str:
    runs = _groups(rows, "run")
    body = []
    for run, steps in runs.items():
        # Compare with the 1-device run of the same batch schedule: "2dev-ramp" -> "1dev-ramp".
        ref = runs.get("1dev-" + run.split("-", 1)[-1])
        diff = max(abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(steps, ref or steps))
        batch = f"{steps[0]['global_batch_size']} .. {steps[-1]['global_batch_size']}"
        body.append(
            [
                run,
                steps[0]["devices"],
                len(steps),
                batch,
                _f(steps[0]["loss"], 4),
                _f(steps[-1]["loss"], 4),
                f"{diff:.1e}" if ref is not None and ref is not steps else "-",
            ]
        )
    header = ["run", "devices", "optimizer steps", "global batch", "first loss", "final loss"]
    return _table([*header, "max loss diff vs one device (CSV's 8-digit losses)"], body)


def scaling_charlm(rows: Rows) -> str:
    body = [
        [
            r["run"],
            r["processes"],
            r["threads_per_process"],
            r["samples"],
            _f(r["samples_per_s"], 1),
            _f(r["ratio_vs_1_process"], 2),
            _f(r["train_loss"], 3),
            _f(r["val_loss"], 3),
            r["wall_s"],
        ]
        for r in rows
    ]
    header = ["run", "processes", "threads each", "samples", "samples/s", "vs one process"]
    return _table([*header, "final train loss", "val loss", "wall s (incl. start-up)"], body)


# ------------------------------------------------------------------------------ the questions


EXPERIMENTS = {  # name for --only -> script, run with its defaults, in this order
    "pipeline": "bench_pipeline.py",
    "pipeline_memory": "bench_pipeline_memory.py",
    "metric_sync": "bench_metric_sync.py",
    "checkpoint": "bench_checkpoint.py",
    "accumulation_equivalence": "accumulation_equivalence.py",
    "scaling_charlm": "scaling_charlm.py",
}


@dataclass(frozen=True)
class Question:
    """One README subsection: its experiment and its tables, one builder per CSV, named after the CSV.

    The plot of a CSV, when there is one, is the PNG of the same name.
    """

    title: str
    experiment: str
    tables: tuple[Callable[[Rows], str], ...]


QUESTIONS = (
    Question(
        "Pipeline overhead: the Trainer against a hand-driven schedule",
        "pipeline",
        (pipeline_overhead,),
    ),
    Question("Pipeline bubble against the number of micro-batches", "pipeline", (pipeline_microbatches,)),
    Question("Memory per rank: DDP against PipelineStrategy", "pipeline_memory", (pipeline_memory,)),
    Question("Metric sync: AllReducedMetrics against sync_dist=True", "metric_sync", (metric_sync,)),
    Question(
        "Checkpoints: Rank0Checkpoint against ModelCheckpoint (stall, memory, SIGKILL)",
        "checkpoint",
        (checkpoint_bench, checkpoint_kill),
    ),
    Question(
        "Gradient accumulation: one device against several at the same global batch",
        "accumulation_equivalence",
        (accumulation_equivalence,),
    ),
    Question("Scaling the main job: one process against two", "scaling_charlm", (scaling_charlm,)),
)


# -------------------------------------------------------------------------------- the machine


def read_csv(path: Path) -> Rows:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_machines(results: Path) -> dict[str, dict[str, str]]:
    path = results / "machine.csv"
    return {r["experiment"]: r for r in read_csv(path)} if path.exists() else {}


def this_machine() -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return dict(
        cpu_model=names[0] if names else platform.processor() or platform.machine(),
        cores=str(os.cpu_count()),
        python=platform.python_version(),
        torch=version("torch"),
        lightning=version("lightning"),
    )


def record_machine(results: Path, experiment: str, date: datetime.date, load: str) -> None:
    """Set ``experiment``'s row of results/machine.csv: this machine, ``date``, the load when it started."""
    rows = read_machines(results)
    rows[experiment] = dict(experiment=experiment, date=date.isoformat(), load_avg_1min=load) | this_machine()
    order = [e for e in EXPERIMENTS if e in rows] + sorted(set(rows) - set(EXPERIMENTS))
    with open(results / "machine.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=MACHINE_FIELDS)
        writer.writeheader()
        writer.writerows(rows[e] for e in order)


def backfill_machines(results: Path) -> None:
    """Results that predate run_all have no machine row: record this machine, dated by the CSV's mtime."""
    known = read_machines(results)
    for q in QUESTIONS:
        first_csv = results / f"{q.tables[0].__name__}.csv"
        if q.experiment not in known and first_csv.exists():
            date = datetime.date.fromtimestamp(first_csv.stat().st_mtime)
            print(f"note: no machine recorded for {q.experiment}: recording this one, dated {date}")
            record_machine(results, q.experiment, date, load="")
            known[q.experiment] = {}


def machine_lines(results: Path) -> tuple[str, dict[str, str]]:
    """A line naming the machine (when all experiments share one), and a 'ran on' line per experiment."""
    rows = read_machines(results)
    describe = {
        e: f"{m['cpu_model']} ({m['cores']} cores), Python {m['python']}, torch {m['torch']}, "
        f"Lightning {m['lightning']}"
        for e, m in rows.items()
    }
    common = next(iter(describe.values())) if len(set(describe.values())) == 1 else None
    ran = {}
    for e, m in rows.items():
        load = f", load average {m['load_avg_1min']} when it started" if m["load_avg_1min"] else ""
        ran[e] = f"_Ran on {m['date']}{load}" + ("" if common else f", on {describe[e]}") + "._"
    return (f"Machine: {common}." if common else ""), ran


# ---------------------------------------------------------------------------------- the block


def table_and_plot(results: Path, readme_dir: Path, q: Question, builder: Callable[[Rows], str]) -> str:
    path = results / f"{builder.__name__}.csv"
    if not path.exists():
        return f"_No results yet: run `python experiments/run_all.py --only {q.experiment}`._"
    try:
        table = builder(read_csv(path))
    except (KeyError, ValueError, IndexError) as err:
        raise SystemExit(
            f"{path.name} does not have the layout {builder.__name__}() in run_all.py expects "
            f"({type(err).__name__}: {err}): update that function to the script's output"
        ) from err
    png = path.with_suffix(".png")
    link = Path(os.path.relpath(png, readme_dir)).as_posix()
    return table + (f"\n\n![{q.title}]({link})" if png.exists() else "")


def build_block(results: Path, readme_dir: Path) -> str:
    """The results block from the CSVs in ``results``; image links are relative to ``readme_dir``."""
    machine, ran = machine_lines(results)
    parts = [
        "_Generated by `make experiments` (`experiments/run_all.py`) from the CSVs in `experiments/results/`;"
        " do not edit by hand. What each experiment measures and how to read it: `experiments/README.md`._",
        machine,
    ]
    for q in QUESTIONS:
        parts += [f"### {q.title}", ran.get(q.experiment, "_Machine not recorded._")]
        for builder in q.tables:
            parts.append(table_and_plot(results, readme_dir, q, builder))
    return "\n\n".join(part for part in parts if part)


def replace_block(text: str, block: str) -> str:
    """``text`` with everything between the markers replaced by ``block``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(
            f"the README needs exactly one '{START}' line followed by one '{END}' line: "
            f"found {text.count(START)} start and {text.count(END)} end markers; add them where the "
            "results section belongs"
        )
    head, rest = text.split(START)
    return f"{head}{START}\n{block}\n{END}{rest.split(END, 1)[1]}"


def run_experiment(name: str) -> None:
    script = HERE / EXPERIMENTS[name]
    print(f"\n=== {name}: {script.name} (defaults) ===", flush=True)
    load = f"{os.getloadavg()[0]:.1f}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.run([sys.executable, str(script)], env=env).returncode
    if code:
        raise SystemExit(
            f"run_all: {script.name} failed with exit code {code} (output above); the README was not "
            f"changed. Fix it, then rerun: python experiments/run_all.py --only {name}"
        )
    record_machine(RESULTS, name, datetime.date.today(), load)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), help="run only these experiments")
    p.add_argument("--skip-run", action="store_true", help="run nothing: rebuild the block from the CSVs")
    p.add_argument("--readme", type=Path, default=README, help=f"the README to update (default {README})")
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help=f"the CSVs to read, with --skip-run (default {RESULTS}, where the scripts write)",
    )
    args = p.parse_args(argv)
    if args.skip_run and args.only:
        p.error("--skip-run and --only exclude each other: --skip-run runs nothing")
    if not args.skip_run and args.results.resolve() != RESULTS:
        p.error(f"--results ({args.results}) needs --skip-run: the scripts always write to {RESULTS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:  # check the markers before a long run, not after it
        replace_block(args.readme.read_text(), "")
    except ValueError as err:
        raise SystemExit(f"{args.readme}: {err}") from err
    if not args.skip_run:
        for name in args.only or list(EXPERIMENTS):
            run_experiment(name)
    backfill_machines(args.results)
    block = build_block(args.results, args.readme.resolve().parent)
    # Read again: the README may have been edited while the experiments ran.
    args.readme.write_text(replace_block(args.readme.read_text(), block))
    print(f"rewrote the results block of {args.readme}")


if __name__ == "__main__":
    main()
