"""Overlapped gradient reduction: the optimizer step with the replicas' all-reduce started during the last
backward (``overlap_gradient_reduction=True``, the default) against the same buckets reduced after it.

For each configuration the two variants (``off``: ``overlap_gradient_reduction=False``; ``on``: the
default) train the same model on the same batches, interleaved (``off on, on off, ...``, ``--repeats``
times each) inside one spawned job of gloo processes, one fit per run:

- ``pp=1 x 2``: ``PipelineStrategy(pipeline_size=1)`` on 2 ranks (2 replicas of the whole model);
- ``pp=1 x 2, zero1``: the same with ``data_parallel="zero1"`` (the all-reduce overlapped alike; ZeRO-1's
  broadcast of the updated parameters after the step is not);
- ``pp=2 x 2``: ``PipelineStrategy(pipeline_size=2)`` on 4 ranks (2 stages x 2 replicas; 1F1B), 4
  processes on this machine's 2 cores;

at two shapes of ``models.SequentialCharLM`` (AdamW, 4 micro-batches per step):

- ``wide``: width 512, 6 blocks, 16 bytes a sample, 4 samples per replica (micro-batches of one
  sample): about 75 MB of gradients per replica against little compute, several 25 MB buckets;
- ``small``: width 128, 4 blocks, 64 bytes, 16 samples per replica (the benchmarks' usual LM, near
  ``make demo``'s): about 3 MB of gradients, one bucket per rank.

Per run, after 2 warm-up steps: the median step time over the timed steps (rank 0's clock, the ranks
lined up by a barrier before and after each step: the job's step), and the median *gradient sync wait*,
the time the optimizer step spends in the gradient synchronisation (from the end of the schedule's
backward to the gradients averaged: the exposed communication), the longest of any rank. The sync is
timed by a benchmark-only wrapper of the strategy's private ``_sync`` (in place for one fit), as
``tests/matrix_checks.py`` reads it; no ``on_before_backward``/``on_after_backward`` hook is used,
since one overridden makes the strategy reduce after the schedule (``hooks_write_gradients``). Also
recorded: the buckets per rank and how many the last backward started (all of them when on, none off).
The ratio on / off is taken within each repeat (the two fits ran back to back).

On this CPU machine gloo's all-reduce runs on threads that share the cores with the backward it overlaps
(and 4 ranks share 2 cores): what the overlap can hide is bounded by idle CPU, not by a separate link or
stream as on a GPU with NCCL. Read the wait column first: it is what the overlap removes from the step.

Writes ``overlap.csv`` and ``overlap.png`` under ``--out-dir``.

Usage::

    python experiments/bench_overlap.py            # about 3-4 minutes on 2 cores
    python experiments/bench_overlap.py --quick    # tiny model, one repeat: checks that it runs
    python experiments/bench_overlap.py --configs "pp=1 x 2" --shapes wide --repeats 7
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel import PipelineStrategy
from lightning_parallel.distributed.dtensors import local
from lightning_parallel.techniques.overlap import BucketedAverage

VARIANTS = ("off", "on")  # the baseline first
MICROBATCHES, WARMUP = 4, 2
CONFIGS = {  # name -> (ranks, pipeline_size, data_parallel)
    "pp=1 x 2": (2, 1, "replicate"),
    "pp=1 x 2, zero1": (2, 1, "zero1"),
    "pp=2 x 2": (4, 2, "replicate"),
}
SHAPES = {  # name -> (width, blocks, bytes a sample, samples per replica)
    "wide": (512, 6, 16, 4),
    "small": (128, 4, 64, 16),
}
QUICK_SHAPE = (32, 2, 8, 4)


class SyncClock(L.Callback):
    """Each optimizer step's gradient sync timed on this rank, and the buckets its backward started.

    A benchmark-only wrapper of the strategy's private ``_sync`` (the optimizer step's gradient
    synchronisation, called once per step after the schedule), in place for one fit.
    """

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.started: list[int] = []
        self.buckets, self.grad_bytes = 0, 0
        self._original: Any = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        sync = self._original = strategy._sync
        averages = [r for r in sync.reductions if isinstance(r, BucketedAverage)]
        self.buckets = sum(len(a.buckets) for a in averages)
        self.grad_bytes = sum(local(p).nbytes for a in averages for p in a.params)

        def timed() -> None:
            start = time.perf_counter()
            sync()
            self.waits.append(time.perf_counter() - start)
            self.started.append(sum(a.started for a in averages))

        strategy._sync = timed

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        strategy._sync = self._original


def timed_fit(config: str, shape: tuple[int, int, int, int], variant: str, steps: int) -> dict[str, float]:
    """One fit of ``WARMUP + steps`` steps; this rank's median step and sync wait over the timed ones."""
    ranks, pipeline_size, data_parallel = CONFIGS[config]
    width, blocks, seq_len, batch = shape
    replicas = ranks // pipeline_size
    torch.manual_seed(0)
    model = SequentialCharLM(dim=width, depth=blocks, seq_len=seq_len)
    strategy = PipelineStrategy(
        pipeline_size=pipeline_size, num_microbatches=MICROBATCHES, partition="parameters",
        data_parallel=data_parallel, overlap_gradient_reduction=variant == "on",
    )  # fmt: skip
    clock, sync = h.StepClock(barrier=True), SyncClock()
    total = WARMUP + steps
    trainer = h.quiet_trainer(
        devices=ranks, strategy=strategy, max_steps=total, limit_val_batches=0, callbacks=[clock, sync]
    )
    data = ByteWindows.of_stdlib((total + 1) * batch * replicas, seq_len)
    trainer.fit(model, DataLoader(data, batch_size=batch, drop_last=True))
    return {
        "step_ms": clock.median_step_ms(warmup=WARMUP),
        "sync_ms": 1e3 * statistics.median(sync.waits[WARMUP:]),
        "buckets": sync.buckets,
        "started": statistics.median(sync.started[WARMUP:]),
        "grad_bytes": sync.grad_bytes,
    }


def worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every configuration of ``world`` ranks, every shape: the variants interleaved (this rank's samples)."""
    samples = []
    for config in (c for c in args["configs"] if CONFIGS[c][0] == world):
        for name, shape in args["shapes"].items():
            variants = {
                v: (lambda v=v, c=config, s=shape: timed_fit(c, s, v, args["steps"])) for v in VARIANTS
            }
            for s in h.interleave(variants, args["repeats"], before_each=h.barrier):
                samples.append(dict(s, config=config, shape=name, rank=rank))
    return samples


# ------------------------------------------------------------------------------ results, on disk


def rows_of(samples: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """One row per configuration, shape and variant: the step (rank 0's clock, the job's step) and its
    ratio to ``off`` in the same repeat; the sync wait (the longest of any rank in each run) and its
    ratio to ``off``'s in the same repeat; the buckets per rank and those started during the backward
    (the largest of any rank)."""
    rows = []
    for (config, shape), mine in _groups(samples, ("config", "shape")).items():
        ranks, pipeline_size, data_parallel = CONFIGS[config]
        width, blocks, seq_len, batch = shapes[shape]
        rank0 = [s for s in mine if s["rank"] == 0]
        runs = [  # one per variant and repeat: the longest wait of any rank
            dict(variant=v, repeat=r, sync_ms=max(s["sync_ms"] for s in run))
            for (v, r), run in _groups(mine, ("variant", "repeat")).items()
        ]
        waits = h.compare(runs, "sync_ms", baseline="off", ratio="sync_ratio", digits=3)
        for row, wait in zip(h.compare(rank0, "step_ms", baseline="off", digits=3), waits):
            ours = [s for s in mine if s["variant"] == row["variant"]]
            job = dict(
                config=config, ranks=ranks, pipeline_size=pipeline_size, replicas=ranks // pipeline_size
            )
            job |= dict(data_parallel=data_parallel, shape=shape, width=width, blocks=blocks, seq_len=seq_len)
            rows.append(
                job
                | dict(batch_per_replica=batch, microbatches=MICROBATCHES)
                | row
                | {k: v for k, v in wait.items() if k not in ("variant", "repeats")}
                | dict(
                    buckets=max(s["buckets"] for s in ours),
                    started=max(s["started"] for s in ours),
                    grad_mb_per_rank=round(max(s["grad_bytes"] for s in ours) / 2**20, 2),
                    bucket_cap_mb=25,
                )
            )
    return rows


def _groups(
    samples: list[dict[str, Any]], keys: tuple[str, ...]
) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for s in samples:
        out.setdefault(tuple(s[k] for k in keys), []).append(s)
    return out


COLUMNS = ["config", "ranks", "pipeline_size", "replicas", "data_parallel", "shape", "width", "blocks",
           "seq_len", "batch_per_replica", "microbatches", "variant", "repeats", "step_ms", "step_ms_min",
           "step_ms_max", "ratio", "ratio_min", "ratio_max", "sync_ms", "sync_ms_min", "sync_ms_max",
           "sync_ratio", "sync_ratio_min", "sync_ratio_max", "buckets", "started", "grad_mb_per_rank",
           "bucket_cap_mb"]  # fmt: skip


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    fig, (left, right) = h.figure(2, size=(12, 4.6))
    on = [r for r in rows if r["variant"] == "on"]
    labels = [f"{r['config']}\n{r['shape']}" for r in on]
    h.errorbars(left, labels, on, "ratio", fmt="o", color="tab:blue", label="step time, on / off")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set(ylabel="ratio on / off per repeat (median, min-max)", title="Step time: overlap on over off")
    xs = range(len(on))
    for offset, variant, colour in ((-0.15, "off", "tab:orange"), (0.15, "on", "tab:green")):
        sel = [r for r in rows if r["variant"] == variant]
        h.errorbars(right, [x + offset for x in xs], sel, "sync_ms", fmt="o", color=colour, label=variant)
    right.set_xticks(list(xs), labels)
    right.set(ylabel="ms (median, min-max)", title="Gradient sync wait after the backward (longest rank)")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("gloo on CPU processes; medians of interleaved repeats, bars: min-max", fontsize=9)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def overlap(rows: t.Rows) -> str:
    body = []
    for (_, shape), pair in t.groups_of(rows, ("config", "shape")).items():
        off, on = (next(r for r in pair if r["variant"] == v) for v in VARIANTS)
        words = {"higher_is_better": False, "words": ("faster", "slower")}
        shorter = {"higher_is_better": False, "words": ("shorter", "longer")}
        job = f"pp {on['pipeline_size']} x dp {on['replicas']} ({on['ranks']} ranks), {on['data_parallel']}"
        model = f"{shape}: width {on['width']}, {on['blocks']} blocks, "
        model += f"{on['batch_per_replica']} x {on['seq_len']} bytes"
        body.append(
            [
                job,
                model,
                t.fixed(on["grad_mb_per_rank"], 1),
                f"{t.fixed(on['started'], 0)} of {on['buckets']}",
                on["repeats"],
                t.timed_col(off, "step_ms", 1),
                t.timed_col(on, "step_ms", 1),
                t.timed_col(on, "ratio", 3, t.ratio_verdict(on, "ratio", **words)),
                t.timed_col(off, "sync_ms", 1),
                t.timed_col(on, "sync_ms", 1),
                t.timed_col(on, "sync_ratio", 2, t.ratio_verdict(on, "sync_ratio", **shorter)),
            ]
        )
    header = ["job", "model", "gradients MiB per rank", "buckets started in backward", "repeats"]
    header += ["step ms off", "step ms on", "step ratio on / off", "sync wait ms off", "sync wait ms on"]
    header += ["sync wait ratio on / off"]
    r0 = rows[0]
    note = (
        f"\n\n`SequentialCharLM`, AdamW, {r0['microbatches']} micro-batches per step, `PipelineStrategy` "
        f"with `overlap_gradient_reduction=False` (off) or the default (on, {r0['bucket_cap_mb']} MB "
        "buckets), the two interleaved in one spawned job of gloo processes (4 ranks share the 2 cores). "
        "Step: rank 0's median step, the ranks lined up before and after each step. Sync wait: the time "
        "the optimizer step spends in the gradient synchronisation after the backward (the exposed "
        "all-reduce), the longest of any rank. Both ratios are taken within each repeat. On CPU gloo's "
        "all-reduce shares the cores with the backward it overlaps; how to read it: [Overlapped gradient "
        "reduction](overlap.md)."
    )
    return t.table(header, body) + note


KEY_COLUMNS = ("step_ms", "step_ms_max", "ratio", "ratio_min", "ratio_max", "sync_ms", "sync_ms_min",
               "started", "sync_ratio", "sync_ratio_min", "sync_ratio_max")  # fmt: skip
RESULTS = t.Results(
    "overlap",
    t.Section(
        "Overlapped gradient reduction: on against off",
        t.Table(
            overlap,
            KEY_COLUMNS,
            timed=True,
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="jobs")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="model shapes")
    p.add_argument("--steps", type=int, default=5, help="timed steps per fit, after 2 warm-up (default 5)")
    args = p.parse_args(argv)
    h.record_machine("overlap", args.out_dir)
    h.quiet()
    start = time.perf_counter()
    shapes = {name: SHAPES[name] for name in args.shapes}
    configs, steps, repeats = args.configs, args.steps, args.repeats
    if args.quick:
        shapes, configs, steps, repeats = {"tiny": QUICK_SHAPE}, ["pp=1 x 2", "pp=2 x 2"], 1, 1
    job = dict(configs=configs, shapes=shapes, steps=steps, repeats=repeats)
    samples = []
    for world in sorted({CONFIGS[c][0] for c in configs}):
        samples += [s for rank in h.spawn(worker, world, job) for s in rank]
    rows = rows_of(samples, shapes)
    h.write_csv(args.out_dir / "overlap.csv", rows, COLUMNS)
    plot(args.out_dir / "overlap.png", rows)
    for r in rows:
        print(
            f"{r['config']:<16} {r['shape']:<6} {r['variant']:<3} step {r['step_ms']:7.1f} ms "
            f"x{r['ratio']:.3f} ({r['ratio_min']:.3f} .. {r['ratio_max']:.3f})  sync wait "
            f"{r['sync_ms']:6.1f} ms x{r['sync_ratio']:.2f} ({r['sync_ratio_min']:.2f} .. "
            f"{r['sync_ratio_max']:.2f})  buckets {r['started']:.0f}/{r['buckets']}"
        )
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
