"""The experiments' one harness: results directory, CSV and PNG writing, the machine record,
multi-process runs, and (from ``_repeats``) interleaved repeats with medians and min-max ranges.

The multi-process runs (ports, ranks, a child's failure shown, the quiet Trainer) are
``lightning_parallel/_testing.py``'s, shared with the tests' harness (``tests/mp_harness.py``): the
scripts import no test module, the tests no script, and both import the package.

Every benchmark script in ``experiments/`` uses it; scripts never import each other or the tests, and
read each other's results from files. Run scripts from the repository root (``python experiments/x.py``):
Python puts the script's own directory on ``sys.path``, so ``import _harness as h`` just works, also in
the processes :func:`spawn` starts. Nothing here runs at import time beyond definitions.

**The method (issue 16).** A timing is never one run against another run. Variants run interleaved
inside one invocation (``A B, B A, ...``, at least :data:`MIN_REPEATS` of each): :func:`interleave`.
:func:`compare` reports the median of the per-repeat ratios against a baseline with their min-max range,
beside the absolute medians; :func:`verdict` words it for docs/results.md ("within noise" when the range
crosses parity or the goal).

**A new benchmark in ~20 lines** (say ``experiments/bench_watchdog.py``)::

    import _harness as h

    def timed_fit(watchdog: bool, steps: int) -> dict:   # one measurement: plain numbers
        clock = h.StepClock()
        trainer = h.quiet_trainer(devices=2, strategy="ddp", max_steps=steps, callbacks=[clock])
        trainer.fit(make_model(watchdog), make_loader())
        return {"step_ms": clock.median_step_ms(warmup=3)}

    def worker(rank: int, world: int, args: dict) -> list[dict]:   # runs on every rank
        variants = {"off": lambda: timed_fit(False, args["steps"]),
                    "on": lambda: timed_fit(True, args["steps"])}
        return h.interleave(variants, repeats=args["repeats"], before_each=h.barrier)

    def main(argv: list[str] | None = None) -> None:
        p = h.parser(__doc__)                        # --out-dir, --repeats, --quick
        p.add_argument("--steps", type=int, default=30)
        args = p.parse_args(argv)
        h.record_machine("watchdog", args.out_dir)
        samples = h.spawn(worker, 2, vars(args))[0]              # rank 0's clock
        rows = h.compare(samples, "step_ms", baseline="off")     # medians, ratios, min-max ranges
        h.write_csv(args.out_dir / "watchdog.csv", rows)
        fig, ax = h.figure()
        h.errorbars(ax, [r["variant"] for r in rows], rows, "step_ms", label="step")
        h.save_figure(fig, args.out_dir / "watchdog.png")

Then, in the same script, what docs/results.md shows of it (``import _tables as t``): one table function
per CSV, named after the CSV (``def watchdog(rows: t.Rows) -> str``; every timing cell through
``t.timed_col``/``t.timed_rows``, so its range shows; ratios with ``t.ratio_verdict``), and the
declaration ``run_all.py`` finds (its place on the page: ``run_all.PAGE_ORDER``, else last)::

    RESULTS = t.Results("watchdog", t.Section("Watchdog: ...", t.Table(watchdog, ("step_ms", "ratio"))))

The PNG of the same name is linked under the table; ``tests/test_run_all.py`` then checks its numbers,
its ranges, and that each key column named there changes the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from _repeats import MIN_REPEATS, Spread, compare, interleave, order, per_repeat_ratios, spread, verdict
from typing_extensions import override

from lightning_parallel import _testing as testing
from lightning_parallel._testing import ChildFailed, free_port, quiet, run_child

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
"""Where every script writes its CSVs and PNGs unless told ``--out-dir``."""
MACHINE_FIELDS = ["experiment", "date", "load_avg_1min", "cpu_model", "cores", "python", "torch", "lightning"]

__all__ = [  # the method, re-exported: a script needs only ``import _harness as h``
    "MIN_REPEATS",
    "RESULTS",
    "ChildFailed",
    "Spread",
    "StepClock",
    "add_model_args",
    "barrier",
    "compare",
    "errorbars",
    "figure",
    "free_port",
    "interleave",
    "order",
    "parser",
    "per_repeat_ratios",
    "quiet",
    "quiet_trainer",
    "read_csv",
    "record_machine",
    "run_child",
    "save_figure",
    "spawn",
    "spread",
    "this_machine",
    "verdict",
    "write_csv",
]

# -------------------------------------------------------------------------------------- arguments


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number of repeats, got {text!r}")
    return int(text)


def parser(doc: str | None, repeats: int | None = MIN_REPEATS) -> argparse.ArgumentParser:
    """An argument parser with the options the scripts share: ``--out-dir``, ``--quick``, and
    ``--repeats`` (default ``repeats``; ``None`` for a script that measures no timing).

    Example::

        args = h.parser(__doc__, repeats=6).parse_args(argv)
        args.out_dir / "x.csv"
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=RESULTS, help=f"where results go (default {RESULTS})")
    p.add_argument("--quick", action="store_true", help="the smallest setting: checks that it runs")
    if repeats is not None:
        p.add_argument(
            "--repeats",
            type=_positive,
            default=repeats,
            help=f"interleaved repeats of each variant (default {repeats}; the results need {MIN_REPEATS}+)",
        )
    return p


# ------------------------------------------------------------------------------------ files


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The main job's model size and batch, as the benchmarks that train it take them on the command line."""
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sample (default 64)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> Path:
    """Write ``rows`` to ``path`` (parents created); columns: ``columns`` or the keys in first-seen order.

    Example::

        h.write_csv(out / "x.csv", [{"k": 1, "ms": 2.5}])
    """
    if not rows:
        raise ValueError(f"no rows to write to {path}: the benchmark measured nothing")
    names = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV as dicts of strings.

    Example::

        rows = h.read_csv(h.RESULTS / "metric_sync.csv")
    """
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def figure(
    ncols: int = 1, nrows: int = 1, size: tuple[float, float] | None = None, **kw: Any
) -> tuple[Any, Any]:
    """A matplotlib figure (headless Agg backend) and its axes, sized by the number of panels;
    ``kw`` goes to ``plt.subplots`` (``sharex=True``, ...).

    Example::

        fig, (left, right) = h.figure(2)
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=size or (5.5 * ncols, 4.2 * nrows), **kw)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close ``fig``.

    Example::

        h.save_figure(fig, out / "x.png")
    """
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path


def errorbars(ax: Any, xs: Sequence[Any], rows: Sequence[Mapping[str, Any]], key: str, **kw: Any) -> None:
    """Plot the medians ``rows[i][key]`` with their min-max range (``key_min``, ``key_max``) as error bars.

    Example::

        h.errorbars(ax, [1, 2, 4], rows, "samples_per_s", label="1f1b", marker="o")
    """
    med = [float(r[key]) for r in rows]
    lo = [m - float(r[f"{key}_min"]) for m, r in zip(med, rows)]
    hi = [float(r[f"{key}_max"]) - m for m, r in zip(med, rows)]
    ax.errorbar(xs, med, yerr=[lo, hi], capsize=3, **kw)


# ------------------------------------------------------------------------------- the machine


def this_machine() -> dict[str, str]:
    """CPU model, core count and the Python / torch / Lightning versions of this machine.

    Example::

        h.this_machine()["cores"]
    """
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


def record_machine(
    experiment: str, out_dir: Path = RESULTS, load: str | None = None, date: datetime.date | None = None
) -> None:
    """Set ``experiment``'s row of ``out_dir/machine.csv``: the date (today), the 1-minute load average
    (now: call it first thing in ``main()``, so it is the load at the start), and this machine.

    Example::

        h.record_machine("metric_sync", args.out_dir)
    """
    path = out_dir / "machine.csv"
    rows = {r["experiment"]: r for r in read_csv(path)} if path.exists() else {}
    load = f"{os.getloadavg()[0]:.1f}" if load is None else load
    day = (date or datetime.date.today()).isoformat()
    rows[experiment] = dict(experiment=experiment, date=day, load_avg_1min=load) | this_machine()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=MACHINE_FIELDS)
        writer.writeheader()
        writer.writerows(rows.values())


# ------------------------------------------------------------------------ multi-process runs


# What the forkserver imports before forking the ranks. Not "__main__": CPython before 3.13.8 never
# preloads it (the server looks for a "main_path" key that spawn.get_preparation_data stopped writing in
# 2013, python/cpython#126631), so every rank re-ran the script's imports. Names from the experiments
# folder would not do either: 3.11's server ignores the sys.path it is given (python/cpython#117378).
PRELOAD = ["torch", "lightning.pytorch", "lightning_parallel"]


def spawn(target: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` fresh processes (gloo initialised, one thread
    each, quiet); return what each rank returned, by rank (``lightning_parallel._testing.spawn``, which
    the tests' harness shares).

    The processes are forkserver workers: the server imports torch, Lightning and lightning_parallel once
    (:data:`PRELOAD`), so a rank starts in a fraction of a second instead of ~5 s of imports.

    Inside ``target`` a ``Trainer(accelerator="cpu", devices=world, strategy=...)`` joins these processes
    instead of launching its own. ``target`` must be a module-level function and return plain data
    (numbers, strings, lists, dicts, tensors): a class defined in a script would not unpickle here.
    A failure on any rank ends every rank and raises here: :class:`ChildFailed` with the traceback of
    each rank whose ``target`` raised, the first one first.

    Example::

        def worker(rank, world, n):
            return {"rank": rank, "sum": n * rank}

        h.spawn(worker, 2, 10)   # [{"rank": 0, "sum": 0}, {"rank": 1, "sum": 10}]
    """
    return testing.spawn(target, world, *args, preload=PRELOAD, quiet_ranks=True)


def barrier() -> None:
    """``dist.barrier()`` when a process group exists (a no-op in one process): line the ranks up."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU ``Trainer`` without logger, checkpoints, progress bar, summary or sanity check, unless asked.

    Example::

        h.quiet_trainer(devices=2, strategy="ddp", max_steps=20).fit(model, loader)
    """
    return testing.quiet_trainer(**{"num_sanity_val_steps": 0, **kwargs})


class StepClock(L.Callback):
    """Records when each training step starts and ends (and its loss) inside ``Trainer.fit``.

    With ``barrier=True`` the ranks are lined up before each step starts and after it ends, so every
    rank times the same step: the job's, not one rank's share of it.

    Example::

        clock = h.StepClock()
        h.quiet_trainer(max_steps=20, callbacks=[clock]).fit(model, loader)
        clock.median_step_ms(warmup=3)
    """

    def __init__(self, barrier: bool = False) -> None:
        self.barrier = barrier
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.losses: list[float] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if self.barrier:
            barrier()
        self.starts.append(time.perf_counter())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *_: Any
    ) -> None:
        if self.barrier:
            barrier()
        self.ends.append(time.perf_counter())
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        self.losses.append(float(loss) if loss is not None else float("nan"))

    def step_seconds(self, warmup: int) -> list[float]:
        """Each step's seconds from its start to its end, after ``warmup`` steps."""
        return [e - s for s, e in zip(self.starts[warmup:], self.ends[warmup:])]

    def median_step_ms(self, warmup: int) -> float:
        """Median milliseconds from a step's start to its end, after ``warmup`` steps."""
        return 1e3 * statistics.median(self.step_seconds(warmup))

    def cycle_quantile_s(self, warmup: int, q: float = 0.5) -> float:
        """A quantile of the step cycles (start to the next start: data, step, hooks), in seconds.

        The median is the typical step; a low quantile the steps that other jobs did not slow down.
        """
        cycles = [b - a for a, b in zip(self.starts[warmup:], self.starts[warmup + 1 :])]
        cycles.append(self.ends[-1] - self.starts[-1])
        if q == 0.5:
            return statistics.median(cycles)
        return sorted(cycles)[min(len(cycles) - 1, int(q * len(cycles)))]


def seconds_by_length(
    timed: Callable[[int], float], seq_len: int, repeats: int, quick: bool = False
) -> list[dict[str, Any]]:
    """``timed(n)`` at a quarter, half and all of ``seq_len``, interleaved over the lengths: one row each
    with the median and range of its seconds (``trace_s``), as the tracing benchmarks report them;
    ``quick`` (a script's ``--quick``): at ``seq_len`` alone, the same code once.

    Example::

        rows = seconds_by_length(lambda n: time_one_trace(n), 64, repeats=5)
    """
    lengths = [seq_len] if quick else [seq_len // 4, seq_len // 2, seq_len]
    samples = interleave({str(n): (lambda n=n: timed(n)) for n in lengths}, repeats=repeats)
    rows = []
    for n in lengths:
        times = [s["value"] for s in samples if s["variant"] == str(n)]
        rows.append({"seq_len": n, "repeats": len(times), **spread(times).cells("trace_s")})
    return rows
