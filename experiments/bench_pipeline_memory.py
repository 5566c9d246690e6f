"""Memory per rank: DDP against PipelineStrategy (p=2 and p=4), the same model, AdamW.

For each run, every rank measures:

- **parameters + gradients + optimizer state**, by counting the bytes of the tensors it holds at the
  moment all three exist (``on_before_optimizer_step`` of the second and later steps: the optimizer
  state exists from the first step on). This is the memory pipeline parallelism exists to divide;
  the issue's target is pipeline p=2 <= 0.55x DDP per rank, and near 1/p as p grows.
- **activations**, separately: the peak of the live bytes of the tensors autograd saves for
  backward (``torch.autograd.graph.saved_tensors_hooks``, parameters excluded). torch's
  ``MemTracker`` was tried first: on torch 2.13 its backward hooks break the pipeline stage's
  ``autograd.grad`` ("A leaf node was passed to _will_engine_execute_node ..."), and it refuses a
  module called more than once per iteration, as a stage is, once per micro-batch. Pipeline and
  DDP see the same global batch: DDP splits it over its ranks, the pipeline (one replica) runs it
  all through each stage in micro-batches.
- **meta-device init**: pipeline runs build the model under ``trainer.init_module(empty_init=True)``;
  each rank then checks that the layers of the *other* stages are still on the meta device after
  setup (never materialised), and that its own are real.

Runs: a larger model (dim 256, 8 blocks) with DDP on 2 processes and the pipeline at p=2 (1f1b and
gpipe); a smaller one (dim 128, 8 blocks) with DDP on 4 processes and the pipeline at p=2 and p=4.
The model is ``models.SequentialCharLM``. Byte counts do not depend on the machine's load, so each run
is measured once (no repeats). Writes ``pipeline_memory.csv`` and ``pipeline_memory.png`` under
``--out-dir``.

Usage::

    python experiments/bench_pipeline_memory.py           # ~2-3 minutes on 2 cores
    python experiments/bench_pipeline_memory.py --quick   # one small model, ~1 minute
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from typing import Any

import _harness as h
import _tables as t
import torch
from _meters import SavedTensorMeter
from lightning.pytorch.callbacks import Callback
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel import PipelineStrategy


@dataclass(frozen=True)
class Run:
    """One measured configuration: DDP or pipeline, how many processes, which model."""

    name: str
    strategy: str  # "ddp" or "pipeline"
    world: int
    dim: int
    depth: int
    schedule: str = "-"
    batch_size: int = 32
    seq_len: int = 64
    num_microbatches: int = 4
    steps: int = 3


def default_runs(quick: bool) -> list[Run]:
    """The runs; a run's ratio is to the DDP run of the same model group (the name before "/")."""
    if quick:  # one small model on 2 processes (the suite's smoke test: a 4-process run costs it ~10 s)
        return [
            Run("quick/ddp x2", "ddp", 2, 64, 8, steps=2),
            Run("quick/pipeline p=2 1f1b", "pipeline", 2, 64, 8, schedule="1f1b", steps=2),
        ]
    big, small = (256, 8), (128, 8)
    return [
        Run("big/ddp x2", "ddp", 2, *big),
        Run("big/pipeline p=2 1f1b", "pipeline", 2, *big, schedule="1f1b"),
        Run("big/pipeline p=2 gpipe", "pipeline", 2, *big, schedule="gpipe"),
        Run("small/ddp x4", "ddp", 4, *small),
        Run("small/pipeline p=2 1f1b", "pipeline", 2, *small, schedule="1f1b"),
        Run("small/pipeline p=4 1f1b", "pipeline", 4, *small, schedule="1f1b"),
        Run("small/pipeline p=4 gpipe", "pipeline", 4, *small, schedule="gpipe"),
    ]


# ------------------------------------------------------------------------------------- counting


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (meta tensors hold none)."""
    seen: dict[int, int] = {}
    for x in tensors:
        if torch.is_tensor(x) and not x.is_meta:
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class MemoryProbe(Callback):
    """Counts this rank's parameter, gradient and optimizer bytes, and its saved activations, over fit."""

    def __init__(self, other_layers: list[torch.nn.Module]) -> None:
        self.other_layers = other_layers  # layers this rank should never materialise (pipeline only)
        self.result: dict[str, Any] = {}
        self.meter: SavedTensorMeter | None = None

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        params = list(pl_module.parameters())
        others = [p for layer in self.other_layers for p in layer.parameters()]
        self.result.update(
            local_params=sum(p.numel() for p in params),
            local_params_meta=sum(p.numel() for p in params if p.is_meta),
            other_stage_params=sum(p.numel() for p in others),
            other_stage_params_meta=sum(p.numel() for p in others if p.is_meta),
            ppo_bytes=0,
        )
        self.meter = SavedTensorMeter(params)
        self.meter.hooks.__enter__()

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not optimizer.state:
            return  # the first step: no optimizer state yet, so not the peak of the three
        params = list(pl_module.parameters())
        counts = dict(
            param_bytes=tensor_bytes(params),
            grad_bytes=tensor_bytes(p.grad for p in params),
            optimizer_bytes=tensor_bytes(optimizer_tensors(optimizer)),
        )
        total = sum(counts.values())
        if total > self.result["ppo_bytes"]:
            self.result.update(counts, ppo_bytes=total)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.meter is None:
            return
        self.meter.hooks.__exit__(None, None, None)
        self.result.update(activation_peak_bytes=self.meter.peak, activation_live_after=self.meter.live)


# -------------------------------------------------------------------------------------- a run


def _model_and_others(run: Run, rank: int, trainer: Any) -> tuple[SequentialCharLM, list[torch.nn.Module]]:
    """The model as each strategy builds it, and the layers of the other stages (pipeline only)."""
    if run.strategy == "ddp":
        torch.manual_seed(0)
        return SequentialCharLM(dim=run.dim, depth=run.depth, seq_len=run.seq_len), []
    with trainer.init_module(empty_init=True):
        model = SequentialCharLM(dim=run.dim, depth=run.depth, seq_len=run.seq_len)
    counts = model.stage_counts(run.world)
    first = sum(counts[:rank])
    mine = range(first, first + counts[rank])
    return model, [layer for i, layer in enumerate(model.layers) if i not in mine]


def memory_worker(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Train ``run.steps`` steps on this rank and return what MemoryProbe counted."""
    per_rank_batch = run.batch_size // world if run.strategy == "ddp" else run.batch_size
    strategy: Any = "ddp"
    if run.strategy == "pipeline":
        strategy = PipelineStrategy(
            pipeline_size=world,
            num_microbatches=run.num_microbatches,
            schedule=run.schedule,
            partition="parameters",
        )
    trainer = h.quiet_trainer(devices=world, strategy=strategy, max_steps=run.steps, limit_val_batches=0)
    model, others = _model_and_others(run, rank, trainer)
    model_params = sum(p.numel() for p in model.parameters())
    probe = MemoryProbe(others)
    trainer.callbacks.append(probe)
    data = ByteWindows.of_stdlib((run.steps + 2) * run.batch_size, run.seq_len)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=per_rank_batch, drop_last=True))
    return dict(
        probe.result,
        rank=rank,
        model_params=model_params,
        max_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )


def measure(run: Run) -> list[dict[str, Any]]:
    ranks = h.spawn(memory_worker, run.world, run)
    return [
        dict(
            run=run.name,
            strategy=run.strategy,
            world_size=run.world,
            schedule=run.schedule,
            model_dim=run.dim,
            model_depth=run.depth,
            global_batch=run.batch_size,
            **r,
        )
        for r in ranks
    ]


# ----------------------------------------------------------------------------------- outputs

COLUMNS = [
    "run",
    "strategy",
    "world_size",
    "schedule",
    "model_dim",
    "model_depth",
    "global_batch",
    "rank",
    "model_params",
    "local_params",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "ppo_bytes",
    "ppo_vs_ddp",
    "activation_peak_bytes",
    "activation_live_after",
    "local_params_meta",
    "other_stage_params",
    "other_stage_params_meta",
    "max_rss_mb",
]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """ppo_vs_ddp: each rank's params+grads+optimizer bytes over DDP's (same model) per-rank bytes."""
    ddp = {r["run"].split("/")[0]: r["ppo_bytes"] for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        base = ddp.get(r["run"].split("/")[0])
        r["ppo_vs_ddp"] = round(r["ppo_bytes"] / base, 4) if base else ""


COLOURS = ("tab:blue", "tab:orange", "tab:green")


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, (top, bottom) = h.figure(1, 2, size=(12, 7.5), sharex=True)
    x, labels, width = 0.0, [], 0.8
    for run in runs:
        ranks = [r for r in rows if r["run"] == run]
        w = width / len(ranks)
        for i, r in enumerate(ranks):
            xi = x - width / 2 + w * (i + 0.5)
            mib = [r[k] / 2**20 for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
            first = not x and not i  # label each colour once
            parts = zip(
                mib, ("tab:blue", "tab:orange", "tab:green"), ("parameters", "gradients", "AdamW state")
            )
            for j, (value, colour, name) in enumerate(parts):
                top.bar(xi, value, w, bottom=sum(mib[:j]), color=colour, label=name if first else None)
            if r["ppo_vs_ddp"] != "" and r["strategy"] != "ddp":
                top.text(xi, sum(mib), f"{r['ppo_vs_ddp']:.2f}x", ha="center", va="bottom", fontsize=7)
            act = r["activation_peak_bytes"] / 2**20
            bottom.bar(xi, act, w, color="tab:red", label="activations (peak)" if first else None)
        labels.append(run.replace("/", "\n"))
        x += 1
    top.set(
        ylabel="memory per rank (MiB)",
        title="Parameters + gradients + AdamW state, one bar per rank (ratio to DDP's per-rank bytes on top)",
    )
    bottom.set(
        ylabel="memory per rank (MiB)",
        title="Peak activations saved for backward, per rank; global batch 32 in every run",
    )
    bottom.set_xticks(range(len(runs)), labels, fontsize=8)
    for ax in (top, bottom):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def pipeline_memory(rows: t.Rows) -> str:
    body = []
    for run, ranks in t.groups(rows, "run").items():
        r0 = ranks[0]
        on_meta = all(r["other_stage_params"] == r["other_stage_params_meta"] for r in ranks)
        body.append(
            [
                run,
                r0["world_size"],
                f"{r0['model_dim']} x {r0['model_depth']}",
                t.mib(max(float(r["ppo_bytes"]) for r in ranks)),
                t.fixed(max(float(r["ppo_vs_ddp"]) for r in ranks), 3),
                " / ".join(t.mib(float(r["activation_peak_bytes"])) for r in ranks),
                "yes" if r0["strategy"] == "pipeline" and on_meta else "-",
                t.fixed(max(float(r["max_rss_mb"]) for r in ranks), 1),
            ]
        )
    header = ["run", "ranks", "width x blocks", "params+grads+AdamW MiB (worst rank)", "vs DDP"]
    header += ["activation peak MiB, rank by rank", "other stages stay on meta", "max RSS MB"]
    return t.table(header, body) + "\n\nByte counts: one run each, they do not depend on the load."


RESULTS = t.Results(
    "pipeline_memory",
    t.Section(
        "Memory per rank: DDP against PipelineStrategy",
        t.Table(pipeline_memory, ("ppo_bytes", "ppo_vs_ddp", "activation_peak_bytes", "max_rss_mb")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__, repeats=None).parse_args(argv)
    h.record_machine("pipeline_memory", args.out_dir)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for run in default_runs(args.quick):
        print(f"measuring {run.name} ...", flush=True)
        rows += measure(run)
    add_ratios(rows)
    h.write_csv(args.out_dir / "pipeline_memory.csv", rows, COLUMNS)
    plot(args.out_dir / "pipeline_memory.png", rows)
    for run in dict.fromkeys(r["run"] for r in rows):
        ranks = [r for r in rows if r["run"] == run]
        worst = max(ranks, key=lambda r: r["ppo_bytes"])
        meta = all(r["other_stage_params"] == r["other_stage_params_meta"] for r in ranks)
        print(
            f"{run:<26} params+grads+AdamW per rank (max) {worst['ppo_bytes'] / 2**20:7.2f} MiB"
            f"  vs DDP {worst['ppo_vs_ddp']}  activations (max) "
            f"{max(r['activation_peak_bytes'] for r in ranks) / 2**20:6.2f} MiB"
            + (f"  other stages still meta: {meta}" if ranks[0]["strategy"] == "pipeline" else "")
        )
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
