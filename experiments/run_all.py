"""Run every experiment, then rebuild docs/results.md's results block from the CSVs in experiments/results/.

Each script runs with its defaults, one after the other, as a subprocess whose output streams through;
the first failure stops everything, the page untouched. Each script records the machine it ran on
(``results/machine.csv``); this one records how long each took and, after a full run, the total
(``results/run_all.csv``). Then the block between ``<!-- results:start -->`` and ``<!-- results:end -->``
in docs/results.md is rewritten (nothing else in the file): how timings are measured, the total time, a table
per question, the plots, and the machine each experiment ran on. Every number in the block is read from a
CSV, or is a median / minimum / maximum / count of a CSV column; every timing comes with its min-max
range over the repeats, and a ratio whose range crosses parity or the goal is said to be "within noise".

An experiment is written in one place, its script: beside the code that writes its CSVs, one table
function per CSV (named after it) and ``RESULTS = t.Results(name, t.Section(title, t.Table(...)))``
(``_tables.py``). This script finds every script that declares ``RESULTS`` and runs them in
:data:`PAGE_ORDER` (the sections' order on the page; an experiment it does not name comes last).

Usage::

    python experiments/run_all.py                        # everything (about 25 minutes on 2 cores)
    python experiments/run_all.py --only scaling_charlm  # one experiment, then the whole block
    python experiments/run_all.py --skip-run             # only rebuild the block from the existing CSVs
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import _harness as h
from _tables import Results, Section, Table

HERE = Path(__file__).resolve().parent
RESULTS = h.RESULTS
PAGE = HERE.parent / "docs" / "results.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
TIMES_FIELDS = ["experiment", "date", "load_avg_1min", "wall_s", "wall_min"]
ALL = "make experiments"  # the row of run_all.csv that holds a full run's total

PAGE_ORDER = (
    "pipeline",
    "schedules",
    "overlap",
    "pipeline_memory",
    "fsdp_memory",
    "memory_validation",
    "metric_sync",
    "checkpoint",
    "dcp_faults",
    "accumulation_equivalence",
    "scaling_charlm",
    "watchdog",
    "gpt_pipeline",
    "hf_pipeline",
    "varlen",
    "hf_pretrained_memory",
    "tensor_parallel",
    "long_context",
    "compile",
    "trace_share",
    "offload",
    "offload_capacity",
    "autoplan",
)
"""The experiments in the order of their sections on the page (and of ``make experiments``' runs)."""


def discover(folder: Path = HERE, order: tuple[str, ...] = PAGE_ORDER) -> dict[str, tuple[str, Results]]:
    """Every script of ``folder`` that declares its ``RESULTS``: experiment name -> (script, results), in
    ``order``, then the others by name. The scripts are imported (``folder`` on ``sys.path``).

    Raises:
        SystemExit: two scripts declare one name, or a name of ``order`` has no script.
    """
    found: dict[str, tuple[str, Results]] = {}
    for path in sorted(folder.glob("*.py")):
        if not re.search(r"^RESULTS = t\.Results\(", path.read_text(), re.MULTILINE):
            continue
        results = importlib.import_module(path.stem).RESULTS
        if results.experiment in found:
            raise SystemExit(
                f"{path.name} and {found[results.experiment][0]} both declare {results.experiment!r}"
            )
        found[results.experiment] = (path.name, results)
    missing = [name for name in order if name not in found]
    if missing:
        raise SystemExit(f"run_all.PAGE_ORDER names {missing}, which no script of {folder} declares")
    return {name: found[name] for name in [*order, *sorted(set(found) - set(order))]}


DECLARED = discover()
EXPERIMENTS = {name: script for name, (script, _) in DECLARED.items()}
"""Name for ``--only`` -> script, run with its defaults, in this order."""
SECTIONS: list[tuple[str, Section]] = [(name, s) for name, (_, r) in DECLARED.items() for s in r.sections]
"""The page's sections, each with its experiment's name."""


# --------------------------------------------------------------------------- machine and times


def read_machines(results: Path) -> dict[str, dict[str, str]]:
    path = results / "machine.csv"
    return {r["experiment"]: r for r in h.read_csv(path)} if path.exists() else {}


def backfill_machines(results: Path) -> None:
    """Results that predate the machine record have no row: record this machine, dated by the CSV."""
    known = read_machines(results)
    for experiment, section in SECTIONS:
        first_csv = results / f"{section.tables[0].name}.csv"
        if experiment not in known and first_csv.exists():
            date = datetime.date.fromtimestamp(first_csv.stat().st_mtime)
            print(f"note: no machine recorded for {experiment}: recording this one, dated {date}")
            h.record_machine(experiment, results, load="", date=date)
            known[experiment] = {}


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


def record_time(results: Path, experiment: str, load: str, seconds: float) -> None:
    """Set ``experiment``'s row of ``results/run_all.csv``: today, the load at its start, its wall time."""
    path = results / "run_all.csv"
    rows = {r["experiment"]: r for r in h.read_csv(path)} if path.exists() else {}
    rows[experiment] = dict(experiment=experiment, date=datetime.date.today().isoformat(), load_avg_1min=load)
    rows[experiment] |= dict(wall_s=f"{seconds:.0f}", wall_min=f"{seconds / 60:.1f}")
    order = [e for e in (*EXPERIMENTS, ALL) if e in rows] + sorted(set(rows) - {*EXPERIMENTS, ALL})
    h.write_csv(path, [rows[e] for e in order], TIMES_FIELDS)


def time_line(results: Path) -> str:
    """The total time of the last full ``make experiments``, and the time of each experiment's last run."""
    path = results / "run_all.csv"
    rows = {r["experiment"]: r for r in h.read_csv(path)} if path.exists() else {}
    total = rows.pop(ALL, None)
    each = ", ".join(f"{e} {r['wall_min']} min" for e, r in rows.items())
    if total is None:
        return f"_Time per experiment (last run of each): {each}._" if each else ""
    return (
        f"_`make experiments` took {total['wall_min']} min in all on {total['date']} (load average "
        f"{total['load_avg_1min']} when it started); last run of each: {each}._"
    )


METHOD = (
    "How timings are measured: a benchmark never compares two separate runs. It runs its variants "
    "interleaved within one invocation (A B, B A, ...; with three the first one rotates), at least five "
    "times each, and shows the median with the min-max range over those repeats beside it, as "
    "`median (min .. max)`. A ratio is taken within each repeat (both variants measured minutes apart "
    "at most) and summarised the same way. Where a ratio's range includes parity or the goal, the table "
    'says "within noise" instead of claiming a difference; otherwise it says the difference held in '
    "every repeat. Byte counts, collective counts, losses and the kill test do not depend on the load."
)


# ---------------------------------------------------------------------------------- the block


def table_and_plot(results: Path, page_dir: Path, experiment: str, section: Section, table: Table) -> str:
    path = results / f"{table.name}.csv"
    if not path.exists():
        return f"_No results yet: run `python experiments/run_all.py --only {experiment}`._"
    try:
        text = table.build(h.read_csv(path))
    except (KeyError, ValueError, IndexError) as err:
        raise SystemExit(
            f"{path.name} does not have the layout {table.name}() in {EXPERIMENTS[experiment]} expects "
            f"({type(err).__name__}: {err}): update that function to the script's output"
        ) from err
    png = path.with_suffix(".png")
    link = Path(os.path.relpath(png, page_dir)).as_posix()
    return text + (f"\n\n![{section.title}]({link})" if png.exists() else "")


def build_block(results: Path, page_dir: Path) -> str:
    """The results block from the CSVs in ``results``; links are relative to ``page_dir``."""
    machine, ran = machine_lines(results)
    guide = Path(os.path.relpath(HERE / "README.md", page_dir)).as_posix()
    parts = [
        "_Generated by `make experiments` (`experiments/run_all.py`) from the CSVs in `experiments/results/`;"
        " do not edit by hand. What each experiment measures and how to read it: "
        f"[experiments/README.md]({guide})._",
        METHOD,
        time_line(results),
        machine,
    ]
    for experiment, section in SECTIONS:
        parts += [f"## {section.title}", ran.get(experiment, "_Machine not recorded._")]
        for table in section.tables:
            parts.append(table_and_plot(results, page_dir, experiment, section, table))
    return "\n\n".join(part for part in parts if part)


def replace_block(text: str, block: str) -> str:
    """``text`` with everything between the markers replaced by ``block``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(
            f"the page needs exactly one '{START}' line followed by one '{END}' line: "
            f"found {text.count(START)} start and {text.count(END)} end markers; add them where the "
            "results section belongs"
        )
    head, rest = text.split(START)
    return f"{head}{START}\n{block}\n{END}{rest.split(END, 1)[1]}"


def run_experiment(name: str) -> None:
    script = HERE / EXPERIMENTS[name]
    print(f"\n=== {name}: {script.name} (defaults) ===", flush=True)
    load, start = f"{os.getloadavg()[0]:.1f}", time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.run([sys.executable, str(script)], env=env).returncode
    if code:
        raise SystemExit(
            f"run_all: {script.name} failed with exit code {code} (output above); the results page was not "
            f"changed. Fix it, then rerun: python experiments/run_all.py --only {name}"
        )
    record_time(RESULTS, name, load, time.perf_counter() - start)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), help="run only these experiments")
    p.add_argument("--skip-run", action="store_true", help="run nothing: rebuild the block from the CSVs")
    p.add_argument("--page", type=Path, default=PAGE, help=f"the results page to update (default {PAGE})")
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
        replace_block(args.page.read_text(), "")
    except ValueError as err:
        raise SystemExit(f"{args.page}: {err}") from err
    if not args.skip_run:
        load, start = f"{os.getloadavg()[0]:.1f}", time.perf_counter()
        for name in args.only or list(EXPERIMENTS):
            run_experiment(name)
        if not args.only:
            record_time(RESULTS, ALL, load, time.perf_counter() - start)
    backfill_machines(args.results)
    block = build_block(args.results, args.page.resolve().parent)
    # Read again: the page may have been edited while the experiments ran.
    args.page.write_text(replace_block(args.page.read_text(), block))
    print(f"rewrote the results block of {args.page}")


if __name__ == "__main__":
    main()
