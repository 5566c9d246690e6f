"""Cost of synchronising K logged scalars per step: AllReducedMetrics vs ``sync_dist=True`` vs no sync.

Two gloo processes (spawned once; every measurement below runs inside them, interleaved):

(a) **In a fit.** For each K, three ``Trainer(strategy="ddp")`` fits that log K scalars per step: no
    sync, ``AllReducedMetrics``, ``self.log(..., sync_dist=True)``. They run interleaved, the first one
    rotating, ``--repeats`` times each. Rank 0 records the step cycle (start of a step to the start of
    the next, so the sync Lightning runs after ``on_train_batch_end`` is inside) and the Python-level
    collectives per step (all_reduce, all_gather, all_gather_object, barrier, broadcast_object_list; not
    the SIGTERM ``broadcast`` Lightning 2.6.6 makes every step anyway, nor DDP's C++ gradient
    all-reduce). Overhead = step time minus the no-sync step time of the same repeat.
(b) **The reduction path alone** (no training, no Trainer; the same process group): per step, K scalars
    reduced the way each method does it. AllReducedMetrics: the values stacked to one float64 vector
    and one ``ScalarReducer.reduce`` (its key layout agreed once, as in a fit). ``sync_dist=True``: what
    Lightning's ``_ResultMetric.update`` calls per logged metric, ``strategy.reduce(value.clone(),
    reduce_op="mean")`` (for DDP: a barrier, an all_reduce and a division). The cost per logged metric
    is the step time over K; the ratio is AllReducedMetrics over sync_dist in the same repeat.

Writes ``metric_sync.csv`` (a), ``metric_sync_reduce.csv`` (b) and ``metric_sync.png``.

Usage::

    python experiments/bench_metric_sync.py            # K = 1 8 32 128, a few minutes on 2 cores
    python experiments/bench_metric_sync.py --ks 1 32 --steps 20 --repeats 7
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_parallel import AllReducedMetrics
from lightning_parallel.distributed.collectives import ScalarReducer

MODES = ("none", "all_reduced_metrics", "sync_dist")
_COUNTED = ("all_reduce", "all_gather", "all_gather_object", "barrier", "broadcast_object_list")
WARMUP = 3  # steps left out of every timing (the key-set agreement of the first logged step among them)


@contextmanager
def counting_collectives() -> Iterator[list[int]]:
    """Count the calls of the collectives in ``_COUNTED`` while the block runs; restore them after.

    A benchmark-only wrapper of ``torch.distributed``'s functions, in place for one measurement: the
    count is what each method costs in collectives, which no public counter reports.
    """
    calls = [0]
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class LogsK(L.LightningModule):
    """A linear regressor that logs K scalars per training step, with or without ``sync_dist``."""

    def __init__(self, k: int, sync_dist: bool) -> None:
        super().__init__()
        self.k, self.sync_dist = k, sync_dist
        self.net = nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log_dict({f"m{i:03d}": loss.detach() + i for i in range(self.k)}, sync_dist=self.sync_dist)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CycleClock(L.Callback):
    """The time and the collective count at each step's start: their differences are per step cycle."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls
        self.marks: list[tuple[float, int]] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self.marks.append((time.perf_counter(), self.calls[0]))

    def per_step(self) -> dict[str, float]:
        marks = self.marks[WARMUP:]
        cycles = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)]
        return {
            "step_ms": 1e3 * statistics.median(t for t, _ in cycles),
            "collectives_per_step": statistics.median(c for _, c in cycles),
        }


def fit_once(mode: str, k: int, steps: int, world: int) -> dict[str, float]:
    """One fit of ``steps`` timed steps (after the warm-up) logging K scalars, synced by ``mode``."""
    n = (WARMUP + steps + 1) * world * 8
    data = TensorDataset(torch.randn(n, 32), torch.randn(n, 1))
    with counting_collectives() as calls:
        clock = CycleClock(calls)
        callbacks = [clock, *([AllReducedMetrics()] if mode == "all_reduced_metrics" else [])]
        trainer = h.quiet_trainer(
            devices=world, strategy="ddp", max_epochs=1, log_every_n_steps=1, callbacks=callbacks
        )
        trainer.fit(LogsK(k, mode == "sync_dist"), DataLoader(data, batch_size=8))
    return clock.per_step()


# --------------------------------------------------------------------- (b) the reduction path alone


def reducer_step(reducer: ScalarReducer, values: list[torch.Tensor]) -> None:
    """AllReducedMetrics' work per logging step: one float64 vector, one ScalarReducer call."""
    numbers = torch.stack([v.to(torch.float64).reshape(()) for v in values]).tolist()
    reducer.reduce({f"m{i:03d}": (x, 8.0, "mean") for i, x in enumerate(numbers)})


def sync_dist_step(strategy: DDPStrategy, values: list[torch.Tensor]) -> None:
    """Lightning's work per step under ``sync_dist=True``: ``strategy.reduce`` once per logged metric,
    on a clone, with the op named after the reduce_fx (``mean``), as ``_ResultMetric.update`` calls it."""
    for v in values:
        strategy.reduce(v.clone(), group=None, reduce_op="mean")


def time_reduction(step: Any, values: list[torch.Tensor], steps: int) -> dict[str, float]:
    with counting_collectives() as calls:
        times = []
        for i in range(WARMUP + steps):
            h.barrier()  # start each step together, as ranks of a fit do
            c0, t0 = calls[0], time.perf_counter()
            step(values)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        per_step = calls[0] - c0  # the last step's
    return {"step_us": 1e6 * statistics.median(times), "collectives_per_step": per_step}


def reduction_variants(k: int, steps: int) -> dict[str, Any]:
    values = [torch.tensor(0.5 + i, dtype=torch.float32) for i in range(k)]
    reducer, strategy = ScalarReducer(), DDPStrategy()
    return {
        "all_reduced_metrics": lambda: time_reduction(lambda v: reducer_step(reducer, v), values, steps),
        "sync_dist": lambda: time_reduction(lambda v: sync_dist_step(strategy, v), values, steps),
    }


# ------------------------------------------------------------------------------- the worker side


def worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    fits, reductions = [], []
    for k in args["ks"]:
        variants = {mode: lambda mode=mode, k=k: fit_once(mode, k, args["steps"], world) for mode in MODES}
        fits += [dict(s, k=k) for s in h.interleave(variants, args["repeats"], before_each=h.barrier)]
    for k in args["ks"]:
        variants = reduction_variants(k, args["reduce_steps"])
        samples = h.interleave(variants, args["repeats"], before_each=h.barrier, warmup=True)
        reductions += [dict(s, k=k, per_metric_us=s["step_us"] / k) for s in samples]
    return {"fits": fits, "reductions": reductions}


# ------------------------------------------------------------------------------ results, on disk


def fit_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (K, method): collectives per step; step time, no-sync step time, overhead and the ratio to
    no sync, each the median over the repeats with its range (overhead and ratio taken per repeat)."""
    rows = []
    for k in dict.fromkeys(s["k"] for s in samples):
        mine = [s for s in samples if s["k"] == k]
        base = {s["repeat"]: s["step_ms"] for s in mine if s["variant"] == "none"}
        for row in h.compare(mine, "step_ms", baseline="none", ratio="ratio_vs_no_sync", digits=3):
            if row["variant"] == "none":
                continue
            mode = row.pop("variant")
            ours = [s for s in mine if s["variant"] == mode]
            collectives = statistics.median(s["collectives_per_step"] for s in ours)
            rows.append(
                dict(k=k, mode=mode, collectives_per_step=collectives)
                | {c: row[c] for c in ("step_ms", "step_ms_min", "step_ms_max")}
                | h.spread(base.values()).cells("no_sync_step_ms", 3)
                | h.spread(s["step_ms"] - base[s["repeat"]] for s in ours).cells("overhead_ms", 3)
                | {
                    c: row[c]
                    for c in ("repeats", "ratio_vs_no_sync", "ratio_vs_no_sync_min", "ratio_vs_no_sync_max")
                }
            )
    return rows


def reduce_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (K, method) of the reduction path alone: cost per step and per logged metric (medians and
    ranges over the repeats), collectives per step, and the per-repeat ratio to sync_dist."""
    rows = []
    for k in dict.fromkeys(s["k"] for s in samples):
        mine = [s for s in samples if s["k"] == k]
        for row in h.compare(mine, "step_us", baseline="sync_dist", ratio="ratio_vs_sync_dist", digits=4):
            ours = [s for s in mine if s["variant"] == row["variant"]]
            rows.append(
                dict(k=k, mode=row.pop("variant"), repeats=row.pop("repeats"))
                | {"collectives_per_step": statistics.median(s["collectives_per_step"] for s in ours)}
                | row
                | h.spread(s["per_metric_us"] for s in ours).cells("per_metric_us", 2)
            )
    return rows


def plot(path: Any, fits: list[dict[str, Any]], reductions: list[dict[str, Any]]) -> None:
    fig, (a, b, c) = h.figure(3)
    for mode in MODES[1:]:
        sel = [r for r in fits if r["mode"] == mode]
        ks = [r["k"] for r in sel]
        a.plot(ks, [r["collectives_per_step"] for r in sel], "o-", label=mode)
        h.errorbars(b, ks, sel, "overhead_ms", marker="o", label=mode)
        sel = [r for r in reductions if r["mode"] == mode]
        h.errorbars(c, [r["k"] for r in sel], sel, "per_metric_us", marker="o", label=mode)
    titles = (
        "collectives per step (in a fit)",
        "step-time overhead vs no sync (ms), in a fit",
        "reduction alone: cost per logged metric (us)",
    )
    ks = sorted({r["k"] for r in fits})
    for ax, title in zip((a, b, c), titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("scalar metrics logged per step (K)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    c.set_yscale("log")
    fig.suptitle("2 gloo processes; medians of interleaved repeats, bars: min-max", fontsize=9)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def metric_sync(rows: t.Rows) -> str:
    at = {(r["k"], r["mode"]): r for r in rows}
    body = []
    for k in sorted({r["k"] for r in rows}, key=int):
        arm, sync = at[(k, "all_reduced_metrics")], at[(k, "sync_dist")]
        words = {"higher_is_better": False, "words": ("below no sync", "above no sync")}
        body.append(
            [
                k,
                arm["repeats"],
                t.fixed(arm["collectives_per_step"], 0),
                t.fixed(sync["collectives_per_step"], 0),
            ]
            + [
                t.timed_col(arm, "no_sync_step_ms", 1),
                t.timed_col(arm, "step_ms", 1),
                t.timed_col(sync, "step_ms", 1),
            ]
            + [
                t.timed_col(x, "overhead_ms", 1, t.ratio_verdict(x, "ratio_vs_no_sync", **words))
                for x in (arm, sync)
            ]
        )
    header = ["metrics K", "repeats", "collectives/step AllReducedMetrics", "collectives/step sync_dist"]
    header += ["step ms, no sync", "step ms AllReducedMetrics", "step ms sync_dist"]
    header += ["overhead ms AllReducedMetrics", "overhead ms sync_dist"]
    return "In a fit (step cycle, overhead against no sync in the same repeat):\n\n" + t.table(header, body)


def metric_sync_reduce(rows: t.Rows) -> str:
    at = {(r["k"], r["mode"]): r for r in rows}
    body = []
    for k in sorted({r["k"] for r in rows}, key=int):
        arm, sync = at[(k, "all_reduced_metrics")], at[(k, "sync_dist")]
        words = {"higher_is_better": False, "words": ("cheaper", "dearer")}
        body.append(
            [
                k,
                arm["repeats"],
                t.fixed(arm["collectives_per_step"], 0),
                t.fixed(sync["collectives_per_step"], 0),
                t.timed_col(arm, "per_metric_us", 1),
                t.timed_col(sync, "per_metric_us", 1),
                t.timed_col(
                    arm, "ratio_vs_sync_dist", 2, t.ratio_verdict(arm, "ratio_vs_sync_dist", **words)
                ),
            ]
        )
    header = ["metrics K", "repeats", "collectives/step AllReducedMetrics", "collectives/step sync_dist"]
    header += ["us per metric AllReducedMetrics", "us per metric sync_dist", "AllReducedMetrics / sync_dist"]
    intro = "The reduction path alone (same process group, no training), cost per logged metric per step:"
    return f"{intro}\n\n" + t.table(header, body)


RESULTS = t.Results(
    "metric_sync",
    t.Section(
        "Metric sync: AllReducedMetrics against sync_dist=True",
        t.Table(
            metric_sync,
            (
                "collectives_per_step",
                "step_ms",
                "step_ms_max",
                "no_sync_step_ms",
                "no_sync_step_ms_min",
                "overhead_ms",
                "overhead_ms_min",
                "overhead_ms_max",
            ),
            timed=True,
        ),
        t.Table(
            metric_sync_reduce,
            (
                "collectives_per_step",
                "per_metric_us",
                "per_metric_us_min",
                "per_metric_us_max",
                "ratio_vs_sync_dist",
                "ratio_vs_sync_dist_min",
                "ratio_vs_sync_dist_max",
            ),
            timed=True,
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32, 128], help="metrics per step")
    p.add_argument("--steps", type=int, default=15, help="timed training steps per fit (default 15)")
    p.add_argument("--reduce-steps", type=int, default=30, help="timed steps per reduction run (default 30)")
    p.add_argument("--devices", type=int, default=2, help="processes (default 2)")
    args = p.parse_args(argv)
    if args.quick:
        args.ks, args.steps, args.reduce_steps = [8], 2, 3  # one K: the same code at any K
    h.record_machine("metric_sync", args.out_dir)
    start = time.perf_counter()
    result = h.spawn(worker, args.devices, vars(args))[0]
    fits, reductions = fit_rows(result["fits"]), reduce_rows(result["reductions"])
    h.write_csv(args.out_dir / "metric_sync.csv", fits)
    h.write_csv(args.out_dir / "metric_sync_reduce.csv", reductions)
    plot(args.out_dir / "metric_sync.png", fits, reductions)
    for r in fits:
        print(
            f"fit   K={r['k']:>3} {r['mode']:<20} {r['collectives_per_step']:>5.0f} collectives/step, "
            f"overhead {r['overhead_ms']:8.2f} ms ({r['overhead_ms_min']:.2f} .. {r['overhead_ms_max']:.2f})"
        )
    for r in reductions:
        words = {"higher_is_better": False, "words": ("cheaper", "dearer")}
        verdict = h.verdict(r["ratio_vs_sync_dist_min"], r["ratio_vs_sync_dist_max"], **words)
        print(
            f"alone K={r['k']:>3} {r['mode']:<20} {r['per_metric_us']:9.1f} us per metric "
            f"({r['per_metric_us_min']:.1f} .. {r['per_metric_us_max']:.1f})"
            + ("" if r["mode"] == "sync_dist" else f", vs sync_dist {r['ratio_vs_sync_dist']:.3f}: {verdict}")
        )
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
