"""Throughput of PipelineStrategy on 2 CPU processes: its overhead, and the pipeline bubble.

(a) **Overhead.** The same 2-stage pipeline (same stage modules, same torch.distributed.pipelining
    schedule with ``scale_grads=False``, same AdamW, same data order) trained two ways in the same
    two processes: under ``Trainer(strategy=PipelineStrategy(...))``, and by a hand-written loop that
    drives ``PipelineStage`` + ``Schedule1F1B``/``ScheduleGPipe`` directly. The runs alternate (hand
    first on even repeats, Trainer first on odd ones) and the ratio is the median of the per-repeat
    ratios. Both runs start from the same weights and see the same batches, so their losses must
    agree: the CSV shows the largest difference, proof that both loops do the same work.
(b) **Micro-batches.** Throughput under PipelineStrategy for num_microbatches in 1, 2, 4, 8, 16, for
    gpipe and 1f1b, divided by p x the throughput of one process training the whole model with the
    same micro-batches (gradient accumulation), both processes busy at once: that efficiency is
    compared with the ideal bubble efficiency m / (m + p - 1). A one-process run alone (the other
    process idle) against the same run with both busy tells whether the two processes really ran in
    parallel on this machine; the script says so.

The model is the byte-level transformer LM of ``experiments/train_charlm.py`` (its layers split
into two stages balanced by parameter count). Writes ``pipeline_overhead.csv``,
``pipeline_microbatches.csv`` and ``pipeline_microbatches.png`` under ``--out-dir``.

Usage::

    python experiments/bench_pipeline.py            # defaults: a few minutes on 2 cores
    python experiments/bench_pipeline.py --quick    # ~30 s smoke run
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from train_charlm import ByteWindows, CharLM, stdlib_text  # noqa: E402

from lightning_parallel import PipelineStrategy  # noqa: E402
from lightning_parallel.pipeline.partition import partition_balanced  # noqa: E402
from lightning_parallel.pipeline.runner import schedule_class  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
P = 2  # pipeline stages = processes
FAST = 0.2  # the quantile of step cycles behind the "fast" columns


@dataclass
class Config:
    """What one benchmark invocation runs (the same object reaches every worker)."""

    dim: int = 128
    depth: int = 4
    seq_len: int = 64
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 3
    steps: int = 15
    overhead_repeats: int = 8
    overhead_schedule: str = "1f1b"
    overhead_microbatches: int = 4
    sweep_repeats: int = 2
    microbatches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    schedules: list[str] = field(default_factory=lambda: ["gpipe", "1f1b"])
    seed: int = 0


# ------------------------------------------------------------------------------------ the model


class BenchLM(CharLM):
    """train_charlm's CharLM with a plain AdamW (no LR schedule), the optimizer the hand loop uses too."""

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.hparams.lr)


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def build_model(cfg: Config) -> BenchLM:
    torch.manual_seed(cfg.seed)
    return BenchLM(dim=cfg.dim, depth=cfg.depth, seq_len=cfg.seq_len, lr=cfg.lr)


def stage_counts(model: nn.Module, num_stages: int) -> list[int]:
    """Layers per stage balanced by parameter count: what ``partition="parameters"`` chooses."""
    return partition_balanced([sum(p.numel() for p in m.parameters()) for m in model.layers], num_stages)


def dataset(cfg: Config) -> Dataset:
    windows = (cfg.warmup + cfg.steps + 2) * cfg.batch_size
    raw = stdlib_text(windows * (cfg.seq_len + 1) + 1)
    return ByteWindows(torch.frombuffer(bytearray(raw), dtype=torch.uint8), cfg.seq_len)


def loader(cfg: Config, data: Dataset) -> DataLoader:
    # The sampler Lightning injects into the Trainer's loader (one replica, shuffled with seed 0),
    # so the hand loop and the Trainer see the same batches in the same order.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)


# ------------------------------------------------------------------------------- timing helpers


@dataclass
class Timing:
    """Per-step start/end times of one run; throughput over the steps after warm-up."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def samples_per_s(self, warmup: int, batch_size: int, quantile: float = 0.5) -> float:
        """Batch size over a quantile of the step cycles (start to next start: fetch, step, hooks).

        The median (0.5) is the typical step; a low quantile (``FAST``) the steps that other jobs on
        a shared machine did not slow down, closer to the code's own cost. Never the mean: another
        job's burst slows a few steps by a lot.
        """
        cycles = [b - a for a, b in zip(self.starts[warmup:], self.starts[warmup + 1 :])]
        cycles.append(self.ends[-1] - self.starts[-1])
        return batch_size / _quantile(cycles, quantile)

    def median_step_ms(self, warmup: int) -> float:
        return 1000 * statistics.median(e - s for s, e in zip(self.starts[warmup:], self.ends[warmup:]))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if q != 0.5 else statistics.median(values)


class StepClock(L.Callback):
    """Records when each training step starts and ends, and its loss, inside Trainer.fit."""

    def __init__(self) -> None:
        self.timing = Timing()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.timing.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.timing.ends.append(time.perf_counter())
        self.timing.losses.append(float(outputs["loss"]))


# ------------------------------------------------------------------------------------ the runs


def run_trainer(cfg: Config, world: int, schedule: str, m: int) -> Timing:
    """Train under Trainer(strategy=PipelineStrategy(...)) for warm-up + timed steps."""
    model = build_model(cfg)
    clock = StepClock()
    strategy = PipelineStrategy(
        num_stages=world, num_microbatches=m, schedule=schedule, partition="parameters"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=cfg.warmup + cfg.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(model, train_dataloaders=loader(cfg, dataset(cfg)))
    expected = stage_counts(build_model(cfg), world)
    got = [len(s.layer_names) for s in strategy.plan.stages]
    if got != expected:
        raise RuntimeError(f"the strategy split the layers {got}, the hand loop {expected}: not the same")
    return clock.timing


def run_hand_loop(cfg: Config, rank: int, world: int, schedule: str, m: int) -> Timing:
    """The same stages and schedule driven by hand: PipelineStage + a torch schedule + AdamW."""
    model = build_model(cfg)
    counts = stage_counts(model, world)
    first = sum(counts[:rank])
    stage_module = nn.Sequential(*list(model.layers)[first : first + counts[rank]])
    del model
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    cls = schedule_class(schedule)
    if m < world:
        cls = ScheduleGPipe  # 1F1B needs m >= stages; PipelineStrategy falls back the same way

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten()) / m

    sched = cls(stage, m, loss_fn=loss_fn, scale_grads=False)
    optimizer = make_optimizer(stage_module.parameters(), cfg.lr)
    timing = Timing()
    for step, (x, y) in enumerate(loader(cfg, dataset(cfg))):
        if step == cfg.warmup + cfg.steps:
            break
        timing.starts.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        optimizer.step()
        timing.ends.append(time.perf_counter())
        timing.losses.append(float(sum(losses)) if losses else float("nan"))
    return timing


def run_single(cfg: Config, m: int) -> Timing:
    """One process trains the whole model, the batch in m micro-batches (gradient accumulation)."""
    model = build_model(cfg).layers
    optimizer = make_optimizer(model.parameters(), cfg.lr)
    timing = Timing()
    for step, (x, y) in enumerate(loader(cfg, dataset(cfg))):
        if step == cfg.warmup + cfg.steps:
            break
        timing.starts.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for xc, yc in zip(x.chunk(m), y.chunk(m)):
            loss = F.cross_entropy(model(xc).flatten(0, 1), yc.flatten()) / m
            loss.backward()
            total += float(loss)
        optimizer.step()
        timing.ends.append(time.perf_counter())
        timing.losses.append(total)
    return timing


# ------------------------------------------------------------------------------- the worker side


def bench_worker(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """Everything one rank runs: (a) then (b); returns this rank's measurements (plain data).

    Timings travel as dicts: a class of a spawned ``__main__`` would not unpickle in the parent.
    """
    overhead, sweep = [], []
    s, m = cfg.overhead_schedule, cfg.overhead_microbatches
    for rep in range(cfg.overhead_repeats):
        order = ["hand", "trainer"] if rep % 2 == 0 else ["trainer", "hand"]
        for mode in order:
            dist.barrier()
            t = run_hand_loop(cfg, rank, world, s, m) if mode == "hand" else run_trainer(cfg, world, s, m)
            overhead.append(dict(rep=rep, mode=mode, first=order[0], timing=asdict(t)))
    for rep in range(cfg.sweep_repeats):
        for i, m in enumerate(cfg.microbatches):
            kinds = [("single", None), *[("pipeline", s) for s in cfg.schedules]]
            shift = (rep + i) % len(kinds)  # rotate the order: no kind always runs first
            for kind, s in kinds[shift:] + kinds[:shift]:
                dist.barrier()
                t = run_single(cfg, m) if kind == "single" else run_trainer(cfg, world, s, m)
                sweep.append(dict(rep=rep, kind=kind, schedule=s or "-", m=m, timing=asdict(t)))
        # The same one-process run with the other process idle: are the two cores really parallel?
        dist.barrier()
        t = run_single(cfg, 1) if rank == 0 else None
        dist.barrier()
        sweep.append(dict(rep=rep, kind="single_alone", schedule="-", m=1, timing=t and asdict(t)))
    return {"rank": rank, "overhead": overhead, "sweep": sweep, "load": os.getloadavg()}


def _worker_entry(local_rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    # Lightning treats processes with LOCAL_RANK set as launched externally (like torchrun) and
    # joins the process group initialised here, so Trainer runs and hand loops share it.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=local_rank, world_size=world)
    try:
        result = fn(local_rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{local_rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes (gloo); return each rank's result.

    A failure on any rank ends all of them (torch.multiprocessing terminates the others) and raises here.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker_entry, (world, port, fn, args, tmp), nprocs=world, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ------------------------------------------------------------------------------ results, on disk


def overhead_rows(cfg: Config, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per repeat: hand vs Trainer samples/s (rank 0's clock), their ratio, loss agreement."""
    rows = []
    first, last = ranks[0]["overhead"], ranks[-1]["overhead"]
    for rep in range(cfg.overhead_repeats):
        by_mode = {r["mode"]: r for r in first if r["rep"] == rep}
        losses = {r["mode"]: r["timing"]["losses"] for r in last if r["rep"] == rep}
        hand, trainer = Timing(**by_mode["hand"]["timing"]), Timing(**by_mode["trainer"]["timing"])
        hand_sps = hand.samples_per_s(cfg.warmup, cfg.batch_size)
        trainer_sps = trainer.samples_per_s(cfg.warmup, cfg.batch_size)
        hand_fast = hand.samples_per_s(cfg.warmup, cfg.batch_size, FAST)
        trainer_fast = trainer.samples_per_s(cfg.warmup, cfg.batch_size, FAST)
        rows.append(
            dict(
                repeat=rep,
                first=by_mode["hand"]["first"],
                schedule=cfg.overhead_schedule,
                num_microbatches=cfg.overhead_microbatches,
                batch_size=cfg.batch_size,
                timed_steps=cfg.steps,
                hand_samples_per_s=round(hand_sps, 2),
                trainer_samples_per_s=round(trainer_sps, 2),
                ratio=round(trainer_sps / hand_sps, 4),
                hand_fast_samples_per_s=round(hand_fast, 2),
                trainer_fast_samples_per_s=round(trainer_fast, 2),
                fast_ratio=round(trainer_fast / hand_fast, 4),
                hand_step_ms_median=round(hand.median_step_ms(cfg.warmup), 2),
                trainer_step_ms_median=round(trainer.median_step_ms(cfg.warmup), 2),
                max_loss_diff=f"{max(abs(a - b) for a, b in zip(losses['hand'], losses['trainer'])):.2e}",
            )
        )
    return rows


def sweep_rows(cfg: Config, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kind, schedule, m): median over repeats of samples/s (typical and fast steps),
    and the efficiency against p x one process with the same micro-batches, beside the ideal."""
    values: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for i, entry in enumerate(ranks[0]["sweep"]):
        # "single": both processes trained a whole model at once; each one's own throughput, averaged.
        entries = [r["sweep"][i] for r in ranks] if entry["kind"] == "single" else [entry]
        timings = [Timing(**e["timing"]) for e in entries]
        typical = statistics.mean(t.samples_per_s(cfg.warmup, cfg.batch_size) for t in timings)
        fast = statistics.mean(t.samples_per_s(cfg.warmup, cfg.batch_size, FAST) for t in timings)
        values.setdefault((entry["kind"], entry["schedule"], entry["m"]), []).append((typical, fast))
    med = {k: [statistics.median(x[j] for x in v) for j in (0, 1)] for k, v in values.items()}
    rows = []
    for (kind, schedule, m), (typical, fast) in sorted(med.items()):
        row = dict(
            kind=kind,
            schedule=schedule,
            num_microbatches=m,
            batch_size=cfg.batch_size,
            repeats=len(values[(kind, schedule, m)]),
            samples_per_s=round(typical, 2),
            fast_samples_per_s=round(fast, 2),
            efficiency="",
            fast_efficiency="",
            efficiency_vs_full_batch="",
            ideal_bubble_efficiency=round(m / (m + P - 1), 4),
        )
        if kind == "pipeline":
            single = med[("single", "-", m)]
            row["efficiency"] = round(typical / (P * single[0]), 4)
            row["fast_efficiency"] = round(fast / (P * single[1]), 4)
            row["efficiency_vs_full_batch"] = round(typical / (P * med[("single", "-", 1)][0]), 4)
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def parallelism(rows: list[dict[str, Any]]) -> float:
    """Each process's one-process throughput with both busy, over the same run alone (1.0 = parallel)."""
    by_kind = {(r["kind"], r["num_microbatches"]): r["samples_per_s"] for r in rows}
    return by_kind[("single", 1)] / by_kind[("single_alone", 1)]


def plot(path: Path, cfg: Config, rows: list[dict[str, Any]], par: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = cfg.microbatches
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    pick = {(r["kind"], r["schedule"], r["num_microbatches"]): r for r in rows}
    for s, marker in zip(cfg.schedules, "os^"):
        label = f"{s}, p={P}"
        left.plot(ms, [pick[("pipeline", s, m)]["samples_per_s"] for m in ms], marker=marker, label=label)
        line = right.plot(
            ms, [pick[("pipeline", s, m)]["efficiency"] for m in ms], marker=marker, label=label
        )
        right.plot(
            ms,
            [pick[("pipeline", s, m)]["fast_efficiency"] for m in ms],
            marker=marker,
            linestyle=":",
            alpha=0.6,
            color=line[0].get_color(),
            label=f"{label}, fastest {FAST:.0%} of steps",
        )
    single = [pick[("single", "-", m)]["samples_per_s"] for m in ms]
    left.plot(ms, [P * v for v in single], "k--", label=f"{P} x one process (same micro-batches)")
    left.plot(ms, single, "k:", label="one process, whole model")
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
        f"2 CPU processes (gloo); parallelism of the 2 processes {par:.2f} (1.0 = fully parallel)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run (small model, few steps)")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help=f"where results go (default {RESULTS})")
    p.add_argument("--dim", type=int, help="model width (default 128)")
    p.add_argument("--depth", type=int, help="transformer blocks (default 4)")
    p.add_argument("--batch-size", type=int, help="samples per step (default 32; a multiple of 16)")
    p.add_argument("--steps", type=int, help="timed steps per run, after warm-up (default 15)")
    p.add_argument("--overhead-repeats", type=int, help="hand/Trainer pairs in (a) (default 8)")
    p.add_argument("--sweep-repeats", type=int, help="repeats of the micro-batch sweep (default 2)")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    cfg = Config()
    if args.quick:
        cfg = Config(dim=64, depth=2, seq_len=32, batch_size=16, warmup=2, steps=4, overhead_repeats=2)
        cfg.sweep_repeats, cfg.microbatches = 1, [1, 4, 16]
    for name in ("dim", "depth", "batch_size", "steps", "overhead_repeats", "sweep_repeats"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if cfg.batch_size % max(cfg.microbatches):
        raise SystemExit(f"--batch-size ({cfg.batch_size}) must be a multiple of {max(cfg.microbatches)}")
    return cfg


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = make_config(args)
    print(f"config: {asdict(cfg)}", flush=True)
    start = time.perf_counter()
    ranks = launch(bench_worker, P, cfg)
    over, sweep = overhead_rows(cfg, ranks), sweep_rows(cfg, ranks)
    out: Path = args.out_dir
    write_csv(out / "pipeline_overhead.csv", over)
    write_csv(out / "pipeline_microbatches.csv", sweep)
    par = parallelism(sweep)
    plot(out / "pipeline_microbatches.png", cfg, sweep, par)
    ratio = statistics.median(r["ratio"] for r in over)
    fast = statistics.median(r["fast_ratio"] for r in over)
    print(
        f"(a) overhead, {cfg.overhead_schedule} m={cfg.overhead_microbatches}: median Trainer/hand ratio "
        f"{ratio:.3f} (target >= 0.95), on the fastest {FAST:.0%} of steps {fast:.3f}; "
        f"hand {_median(over, 'hand_samples_per_s'):.1f}, "
        f"Trainer {_median(over, 'trainer_samples_per_s'):.1f} samples/s"
    )
    for r in sweep:
        if r["kind"] == "pipeline":
            print(
                f"(b) {r['schedule']:>5} m={r['num_microbatches']:>2}: {r['samples_per_s']:7.1f} samples/s, "
                f"efficiency {r['efficiency']:.3f}, fastest steps {r['fast_efficiency']:.3f} "
                f"(ideal {r['ideal_bubble_efficiency']:.3f})"
            )
    verdict = (
        "the two processes ran in parallel, so the curve shape is meaningful"
        if par >= 0.85
        else "the two processes did NOT get a core each (other load on the machine): the efficiencies "
        "are pessimistic and the curve shape only indicative"
    )
    print(
        f"parallelism {par:.2f} (one process's throughput with both busy / alone): {verdict}. "
        f"Load average at the end: {', '.join(f'{x:.1f}' for x in ranks[0]['load'])} on {os.cpu_count()} "
        f"cores. Wrote {out}/pipeline_overhead.csv, pipeline_microbatches.csv and .png "
        f"in {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
