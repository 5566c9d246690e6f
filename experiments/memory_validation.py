"""Does the memory planner predict what torch measures? Every prediction against MemTracker, rank by rank.

For each configuration (DDP; pipelines with p = 2 and 4; gpipe, 1f1b, interleaved; m in {2, 4, 8};
with and without recomputation; optimizer state sharded or not; fp32 and bf16-mixed), the same
model, seed and batch are

- **predicted** by ``lightning_parallel.memory.estimate_memory`` in this process (no training), and
- **measured** on every rank by torch's own meter, ``torch.distributed._tools.mem_tracker.MemTracker``,
  around one training step after a warm-up step (the optimizer state exists by then), under the real
  ``Trainer`` with gloo on CPU. The tracker counts every tensor an operator creates inside it, plus
  the tensors it is told of (``track_external``): the model, its gradients, the optimizer state, the
  batch, and the pipeline's receive buffers (allocated at the first step, outside the tracked one).

The tracker's module hooks are turned off (see ``blind_to_modules``): they refuse a module called once
per micro-batch, as a pipeline stage is ("does not support ... multiple iterative calls", torch 2.13),
and only attribute memory to modules; the peak is counted by the dispatch mode either way.

Writes ``memory_validation.csv`` (one row per rank) and ``memory_validation.png`` (predicted against
measured) under ``--out-dir``; prints the table with the error on the worst rank of each configuration.

Usage::

    python experiments/memory_validation.py            # 16 configurations, ~10-15 minutes on 2 cores
    python experiments/memory_validation.py --quick    # 2 small configurations, ~1 minute
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import PipelineStrategy
from lightning_parallel.memory.config import ParallelConfig
from lightning_parallel.memory.estimate import MemoryEstimate, format_bytes, predict
from lightning_parallel.memory.facts import measure_model
from lightning_parallel.pipeline.zero import local_state_bytes

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.15

# ------------------------------------------------------------------------------------------ model


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """A pre-norm causal transformer block (the main job's)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class LM(L.LightningModule):
    """The byte-level LM of experiments/train_charlm.py (its layers in one nn.Sequential), AdamW."""

    def __init__(self, dim: int = 128, depth: int = 8, heads: int = 4, seq_len: int = 64) -> None:
        super().__init__()
        blocks = [Block(dim, heads) for _ in range(depth)]
        self.layers = nn.Sequential(
            Embedding(256, dim, seq_len), *blocks, nn.LayerNorm(dim), nn.Linear(dim, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class GPT(LM):
    """GPT-shaped, without a Sequential: blocks in an nn.ModuleList, the head tied to the embedding."""

    def __init__(self, dim: int = 128, depth: int = 8, heads: int = 4, seq_len: int = 64) -> None:
        L.LightningModule.__init__(self)
        self.wte, self.wpe = nn.Embedding(256, dim), nn.Embedding(seq_len, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, 256, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Case:
    """One configuration: a ParallelConfig plus the per-replica batch and the model shape."""

    name: str
    strategy: str
    devices: int
    pipeline_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    checkpointing: bool = False
    sharded: bool = False
    precision: str = "32-true"
    batch: int = 16  # per replica
    dim: int = 128
    depth: int = 8
    seq_len: int = 64
    model: str = "lm"  # or "gpt": GPT-shaped (ModuleList of blocks, tied head)

    def config(self) -> ParallelConfig:
        return ParallelConfig(
            self.strategy, self.devices, self.pipeline_size, self.num_microbatches, self.schedule,
            self.stages_per_rank, "uniform", self.checkpointing, self.sharded, self.precision,
        )  # fmt: skip


def cases(quick: bool) -> list[Case]:
    if quick:
        return [
            Case("ddp x2", "ddp", 2, batch=8, depth=4),
            Case("pp 2x1 1f1b m=4 +ac", "pipeline", 2, 2, 4, checkpointing=True, depth=4),
        ]
    return [
        Case("ddp x2", "ddp", 2, batch=8),
        Case("ddp x2 bf16", "ddp", 2, batch=8, precision="bf16-mixed"),
        Case("ddp x2 gpt-shaped tied", "ddp", 2, batch=8, model="gpt"),
        Case("pp 2x1 gpipe m=4", "pipeline", 2, 2, 4, "gpipe"),
        Case("pp 2x1 1f1b m=2", "pipeline", 2, 2, 2),
        Case("pp 2x1 1f1b m=4", "pipeline", 2, 2, 4),
        Case("pp 2x1 1f1b m=8", "pipeline", 2, 2, 8),
        Case("pp 2x1 1f1b m=4 +ac", "pipeline", 2, 2, 4, checkpointing=True),
        Case("pp 2x1 1f1b m=4 bf16", "pipeline", 2, 2, 4, precision="bf16-mixed"),
        Case("pp 2x1 interleaved m=4", "pipeline", 2, 2, 4, "interleaved_1f1b", 2),
        Case("pp 2x1 interleaved m=8 +ac", "pipeline", 2, 2, 8, "interleaved_1f1b", 2, checkpointing=True),
        Case("pp 4x1 1f1b m=8", "pipeline", 4, 4, 8),
        Case("pp 4x1 gpipe m=4", "pipeline", 4, 4, 4, "gpipe"),
        Case("pp 4x1 1f1b m=8 +ac bf16", "pipeline", 4, 4, 8, checkpointing=True, precision="bf16-mixed"),
        Case("pp 2x2 1f1b m=4", "pipeline", 4, 2, 4),
        Case("pp 2x2 1f1b m=4 +zero", "pipeline", 4, 2, 4, sharded=True),
        Case("pp 1x4 1f1b m=4 +zero", "pipeline", 4, 1, 4, sharded=True),
    ]


def batch_for(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (case.batch, case.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def build_model(case: Case) -> LM:
    torch.manual_seed(0)
    cls = GPT if case.model == "gpt" else LM
    return cls(dim=case.dim, depth=case.depth, seq_len=case.seq_len)


# ------------------------------------------------------------------------------------ measuring


def blind_to_modules(tracker: MemTracker) -> MemTracker:
    """Turn off MemTracker's per-module attribution; its dispatch-mode byte counting stays as it is.

    torch 2.13's MemTracker attributes memory to modules through a ModTracker whose hooks raise on a
    module called more than once per iteration ("multiple iterative calls"): a pipeline stage runs
    once per micro-batch. The peak (``get_tracker_snapshot("peak")["Total"]``) is computed in
    ``__torch_dispatch__`` from every tensor created, and reads only ``parents`` and ``is_bw`` of the
    module tracker, which this stand-in provides. No public switch exists; if the attribute moves,
    ``tracker._mod_tracker`` is missing and this fails loudly.
    """
    if not hasattr(tracker, "_mod_tracker"):
        raise RuntimeError("MemTracker has no _mod_tracker: torch changed it (checked against 2.13)")

    class _NoModules:
        parents = {"Global"}

        @property
        def is_bw(self) -> bool:
            return torch._C._current_graph_task_id() != -1

        def register_user_hooks(self, *hooks: Any) -> None: ...
        def clear_user_hooks(self) -> None: ...
        def __enter__(self) -> _NoModules:
            return self

        def __exit__(self, *exc: Any) -> None: ...

    tracker._mod_tracker = _NoModules()
    return tracker


def pipeline_buffers(strategy: Any) -> list[torch.Tensor]:
    """The receive buffers of this rank's cached pipeline stages (allocated at the warm-up step).

    torch 2.13 keeps them in ``PipelineStage.args_recv_info`` / ``grad_recv_info`` (one ``_RecvInfo``
    per micro-batch with a ``buffer``); the runner caches the schedules in ``_cache``. Both private:
    used here only to tell the meter about tensors that exist outside the tracked step.
    """
    runner = getattr(strategy, "_runner", None)
    if runner is None:
        return []
    out = []
    for schedule in runner._cache.values():
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                out += [i.buffer for i in infos if torch.is_tensor(getattr(i, "buffer", None))]
    return out


class StepMeter(L.Callback):
    """MemTracker around training step ``step`` (after warm-up); the peak total bytes of this rank."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.peak = 0
        self.start = 0
        self.tracker: MemTracker | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.step:
            return
        self.tracker = blind_to_modules(MemTracker())
        extra = pipeline_buffers(trainer.strategy)
        # A ZeroRedundancyOptimizer keeps its shard's state in the local optimizer it wraps (.optim).
        optimizers = [getattr(o, "optim", o) for o in trainer.optimizers]
        self.tracker.track_external(pl_module, *optimizers, batch, *extra)
        self.start = _total(self.tracker.get_tracker_snapshot("current"))
        self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.step or self.tracker is None:
            return
        self.tracker.__exit__(None, None, None)
        self.peak = _total(self.tracker.get_tracker_snapshot("peak"))


def _total(snapshot: dict) -> int:
    return int(sum(dev.get("Total", 0) for dev in snapshot.values()))


def worker(rank: int, world: int, port: int, case: Case, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        meter = StepMeter()
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=_strategy(case), precision=case.precision,
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[meter],
        )  # fmt: skip
        x, y = batch_for(case)
        # Every rank reads the same batch each step, so each rank's prediction input is exact.
        data = TensorDataset(x.repeat(2 * world, 1), y.repeat(2 * world, 1))
        trainer.fit(build_model(case), DataLoader(data, batch_size=case.batch))
        record = {"rank": rank, "measured": meter.peak, "start": meter.start,
                  "optimizer_state": local_state_bytes(trainer.optimizers[0])}  # fmt: skip
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _strategy(case: Case) -> Any:
    if case.strategy == "ddp":
        return "ddp"
    return PipelineStrategy(
        num_stages=case.pipeline_size, num_microbatches=case.num_microbatches, schedule=case.schedule,
        stages_per_rank=case.stages_per_rank, activation_checkpointing=case.checkpointing,
        shard_optimizer_state=case.sharded,
    )  # fmt: skip


def launch(case: Case) -> list[dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, (case.devices, port, case, tmp), nprocs=case.devices, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(case.devices)]


# ------------------------------------------------------------------------------------ comparing


def rows_for(case: Case, estimate: MemoryEstimate, measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    dp = case.config().data_parallel_size
    rows = []
    for record in measured:
        rank = record["rank"]
        predicted = estimate.ranks[0 if case.strategy == "ddp" else rank // dp]
        rows.append(
            dict(
                config=case.name, **{k: v for k, v in asdict(case).items() if k != "name"},
                rank=rank, measured_bytes=record["measured"], predicted_bytes=predicted.peak,
                error=round(predicted.peak / record["measured"] - 1, 4),
                predicted_parameters=predicted.parameters, predicted_gradients=predicted.gradients,
                predicted_optimizer=predicted.optimizer, predicted_activations=predicted.activations,
                predicted_buffers=predicted.buffers, in_flight="/".join(map(str, predicted.in_flight)),
                measured_optimizer_state=record["optimizer_state"], tracked_at_start=record["start"],
            )
        )  # fmt: skip
    worst = max(rows, key=lambda r: r["measured_bytes"])
    for r in rows:
        r["worst_rank"] = r is worst
    return rows


def run(case: Case) -> list[dict[str, Any]]:
    model = build_model(case)
    estimate = predict(measure_model(model, batch_for(case), case.precision), case.config())
    return rows_for(case, estimate, launch(case))


# ------------------------------------------------------------- results on disk (local until _harness.py)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 6.5))
    measured = [r["measured_bytes"] / 2**20 for r in rows]
    predicted = [r["predicted_bytes"] / 2**20 for r in rows]
    top = max(measured + predicted) * 1.08
    line = [0, top]
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    low, high = [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)]
    ax.fill_between(line, low, high, color="tab:green", alpha=0.12, label=f"within +/-{TOLERANCE:.0%}")
    worst = [r["worst_rank"] for r in rows]
    ax.scatter([m for m, w in zip(measured, worst) if not w], [p for p, w in zip(predicted, worst) if not w],
               s=18, color="tab:blue", alpha=0.6, label="other ranks")  # fmt: skip
    ax.scatter([m for m, w in zip(measured, worst) if w], [p for p, w in zip(predicted, worst) if w],
               s=34, color="tab:red", label="worst rank of a configuration")  # fmt: skip
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured peak, MemTracker (MiB)",
           ylabel="predicted peak, estimate_memory (MiB)",
           title="Per-rank peak memory of one training step: predicted vs measured")  # fmt: skip
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'configuration':<30} {'ranks':>5} {'measured':>11} {'predicted':>11} {'error':>7}  "
             f"{'max |error| any rank':>20}"]  # fmt: skip
    for name in dict.fromkeys(r["config"] for r in rows):
        ranks = [r for r in rows if r["config"] == name]
        w = next(r for r in ranks if r["worst_rank"])
        any_rank = max(abs(r["error"]) for r in ranks)
        lines.append(
            f"{name:<30} {len(ranks):>5} {format_bytes(w['measured_bytes']):>11} "
            f"{format_bytes(w['predicted_bytes']):>11} {w['error']:>+7.1%}  {any_rank:>20.1%}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 small configurations (~1 minute)")
    p.add_argument("--only", nargs="*", help="run only the configurations with these names")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help=f"where results go (default {RESULTS})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in cases(args.quick):
        if args.only and case.name not in args.only:
            continue
        print(f"measuring {case.name} ...", flush=True)
        rows += run(case)
    write_csv(args.out_dir / "memory_validation.csv", rows)
    plot(args.out_dir / "memory_validation.png", rows)
    print(summary(rows))
    bad = [r for r in rows if r["worst_rank"] and abs(r["error"]) > TOLERANCE]
    print(f"{len(rows)} ranks in {time.perf_counter() - start:.0f} s; worst-rank errors beyond "
          f"+/-{TOLERANCE:.0%}: {len(bad)}; wrote {args.out_dir}/memory_validation.csv and .png")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
