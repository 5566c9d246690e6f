"""Memory per rank on 4 processes: DDP against a pipeline of 2 stages x 2 replicas, plain, ZeRO-1 and FSDP2.

The same model (``models.SequentialCharLM``, width 256, 8 blocks, AdamW), the same global batch (16
windows of 64 bytes) on 4 gloo processes, four ways:

- ``ddp x4``: every rank holds the whole model, its gradients and its AdamW state;
- ``pp 2x2``: ``PipelineStrategy(pipeline_size=2)``, each stage replicated on 2 ranks;
- ``pp 2x2 +zero1``: the same, the optimizer state of each stage sharded over its 2 replicas;
- ``pp 2x2 +fsdp``: ``data_parallel="fsdp"``, each stage's parameters, gradients and optimizer state
  sharded over its 2 ranks with FSDP2 (ZeRO-3).

Each rank measures, in the same processes (one spawn, the four runs in turn):

- **parameters + gradients + optimizer state**: the bytes of the tensors this rank holds when all three
  exist (``on_before_optimizer_step`` of the second step: after the gradient reduction, with the
  optimizer state; a DTensor counts its local shard, FSDP2's padding included). FSDP2 should bring it to
  1 / (stages x shards) of DDP's.
- **peak** of the second training step, counted by torch's ``MemTracker`` as ``memory_validation.py``
  does, with the same ``_meters.StepMeter`` (parameters, gradients, optimizer state, activations,
  buffers, and FSDP2's unsharded parameters: under a pipeline FSDP2 keeps its stage gathered for the
  whole step, ``reshard_after_forward=False``).
- the memory planner's **predicted** peak for the same configuration, beside it.

Byte counts do not depend on the machine's load: one run each. Writes ``fsdp_memory.csv`` and
``fsdp_memory.png`` under ``--out-dir``.

Usage::

    python experiments/bench_fsdp_memory.py            # ~2 minutes on 2 quiet cores
    python experiments/bench_fsdp_memory.py --quick    # width 32, 2 blocks: to check that it runs
"""

from __future__ import annotations

import gc
import time
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from _meters import StepMeter
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel import PipelineStrategy
from lightning_parallel.distributed.dtensors import local
from lightning_parallel.optim.sharded import local_state_bytes
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import measure_model

WORLD, DIM, DEPTH, SEQ_LEN, GLOBAL_BATCH, MICROBATCHES, STEPS = 4, 256, 8, 64, 16, 4, 2
PLAN = dict(devices=WORLD, pipeline_size=2, num_microbatches=MICROBATCHES, partition="parameters")
RUNS = {  # name -> (strategy, the planner's ParallelPlan)
    "ddp x4": ("ddp", ParallelPlan("ddp", WORLD)),
    "pp 2x2": (dict(), ParallelPlan("pipeline", **PLAN)),
    "pp 2x2 +zero1": (dict(data_parallel="zero1"), ParallelPlan("pipeline", **PLAN, data_parallel="zero1")),
    "pp 2x2 +fsdp": (dict(data_parallel="fsdp"), ParallelPlan("pipeline", **PLAN, data_parallel="fsdp")),
}


def model(shape: tuple[int, int]) -> SequentialCharLM:
    torch.manual_seed(0)
    return SequentialCharLM(dim=shape[0], depth=shape[1], seq_len=SEQ_LEN)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard's storage)."""
    seen: dict[int, int] = {}
    for x in tensors:
        if torch.is_tensor(x):
            storage = local(x).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class Held(L.Callback):
    """Parameters, gradients and optimizer state this rank holds before the optimizer's second step."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if trainer.global_step != STEPS - 1:
            return
        params = list(pl_module.parameters())
        self.counts = dict(
            param_bytes=storage_bytes(params),
            grad_bytes=storage_bytes(p.grad for p in params if p.grad is not None),
            optimizer_bytes=local_state_bytes(optimizer),
        )


def worker(rank: int, world: int, shape: tuple[int, int]) -> list[dict[str, Any]]:
    data = ByteWindows.of_stdlib((STEPS + 1) * GLOBAL_BATCH, SEQ_LEN)
    out = []
    for name, (kind, config) in RUNS.items():
        strategy: Any = "ddp" if kind == "ddp" else PipelineStrategy(
            pipeline_size=2, num_microbatches=MICROBATCHES, partition="parameters", **kind
        )  # fmt: skip
        held, meter = Held(), StepMeter(step=STEPS - 1)
        trainer = h.quiet_trainer(devices=world, strategy=strategy, max_steps=STEPS, callbacks=[held, meter])
        batch = GLOBAL_BATCH // config.data_parallel_size
        trainer.fit(model(shape), DataLoader(data, batch_size=batch, drop_last=True))
        out.append(dict(run=name, rank=rank, **held.counts, peak_bytes=meter.peak))
        del trainer
        gc.collect()  # the last run's model and optimizer go before the next one's tracked step
    return out


def with_predictions(rows: list[dict[str, Any]], shape: tuple[int, int]) -> list[dict[str, Any]]:
    """The planner's prediction of each rank's peak (its pipeline rank's), and the ratios to DDP."""
    m = model(shape)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ_LEN))
    facts = measure_model(m, (x, x), optimizer=torch.optim.AdamW(m.parameters(), weight_decay=0.01))
    ddp = {k: max(r[k] for r in rows if r["run"] == "ddp x4") for k in ("ppo_bytes", "peak_bytes")}
    for r in rows:
        config = RUNS[r["run"]][1]
        estimate = predict(facts, config, samples=GLOBAL_BATCH // config.data_parallel_size)
        mine = estimate.ranks[r["rank"] // config.data_parallel_size if config.strategy == "pipeline" else 0]
        r.update(
            pp_rank=r["rank"] // config.data_parallel_size if config.strategy == "pipeline" else "-",
            ppo_vs_ddp=round(r["ppo_bytes"] / ddp["ppo_bytes"], 4),
            peak_vs_ddp=round(r["peak_bytes"] / ddp["peak_bytes"], 4),
            predicted_peak_bytes=mine.peak,
            predicted_error=round(mine.peak / r["peak_bytes"] - 1, 4),
            predicted_gathered_bytes=mine.gathered,
        )
    return rows


COLUMNS = ["run", "rank", "pp_rank", "param_bytes", "grad_bytes", "optimizer_bytes", "ppo_bytes",
           "ppo_vs_ddp", "peak_bytes", "peak_vs_ddp", "predicted_peak_bytes", "predicted_error",
           "predicted_gathered_bytes", "model_dim", "model_depth", "global_batch",
           "num_microbatches"]  # fmt: skip


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    runs = list(RUNS)
    fig, (top, bottom) = h.figure(1, 2, size=(11, 7.5), sharex=True)
    width = 0.8 / WORLD
    for x, run in enumerate(runs):
        for i, r in enumerate(sorted((r for r in rows if r["run"] == run), key=lambda r: r["rank"])):
            xi = x - 0.4 + width * (i + 0.5)
            parts = [r[k] / 2**20 for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
            names = ("parameters", "gradients", "AdamW state")
            for j, (mib, colour, name) in enumerate(
                zip(parts, ("tab:blue", "tab:orange", "tab:green"), names)
            ):
                label = name if x == 0 and i == 0 else None
                top.bar(xi, mib, width, bottom=sum(parts[:j]), color=colour, label=label)
            top.text(xi, sum(parts), f"{r['ppo_vs_ddp']:.2f}x", ha="center", va="bottom", fontsize=7)
            first = x == 0 and i == 0
            bottom.bar(
                xi,
                r["peak_bytes"] / 2**20,
                width,
                color="tab:red",
                label="measured (MemTracker)" if first else None,
            )
            bottom.scatter(xi, r["predicted_peak_bytes"] / 2**20, color="black", marker="_", s=120, zorder=3,
                           label="predicted (estimate_memory)" if first else None)  # fmt: skip
    top.set(
        ylabel="MiB per rank", title="Parameters + gradients + AdamW state per rank (ratio to DDP's on top)"
    )
    bottom.set(ylabel="MiB per rank", title="Peak of a training step per rank: measured and predicted")
    bottom.set_xticks(range(len(runs)), runs)
    for ax in (top, bottom):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def fsdp_memory(rows: t.Rows) -> str:
    body = []
    for run, ranks in t.groups(rows, "run").items():
        ppo = max(ranks, key=lambda r: float(r["ppo_bytes"]))
        peak = max(ranks, key=lambda r: float(r["peak_bytes"]))
        body.append(
            [run, len(ranks), t.mib(float(ppo["param_bytes"])), t.mib(float(ppo["grad_bytes"])),
             t.mib(float(ppo["optimizer_bytes"])), t.mib(float(ppo["ppo_bytes"])),
             t.fixed(ppo["ppo_vs_ddp"], 3), t.mib(float(peak["peak_bytes"])), t.fixed(peak["peak_vs_ddp"], 3),
             t.mib(float(peak["predicted_peak_bytes"])), t.fixed(peak["predicted_error"], 3)]
        )  # fmt: skip
    header = ["run", "ranks", "parameters MiB", "gradients MiB", "AdamW state MiB", "sum MiB (worst rank)"]
    header += ["vs DDP", "peak MiB (worst rank, MemTracker)", "vs DDP", "predicted peak MiB", "error"]
    r0 = rows[0]
    return t.table(header, body) + (
        f"\n\n`SequentialCharLM` width {r0['model_dim']}, {r0['model_depth']} blocks, AdamW, global batch "
        f"{r0['global_batch']}, {r0['num_microbatches']} micro-batches; parameters, gradients and state "
        "counted before the second optimizer step (a DTensor: its local shard). Byte counts: one run each, "
        "they do not depend on the load."
    )


RESULTS = t.Results(
    "fsdp_memory",
    t.Section(
        "Memory per rank with the stages sharded: replicas, sharded optimizer state, FSDP2 (pipeline 2 x 2)",
        t.Table(
            fsdp_memory,
            (
                "ppo_bytes",
                "ppo_vs_ddp",
                "peak_bytes",
                "peak_vs_ddp",
                "predicted_peak_bytes",
                "predicted_error",
            ),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__, repeats=None).parse_args(argv)
    h.record_machine("fsdp_memory", args.out_dir)
    h.quiet()
    start = time.perf_counter()
    shape = (32, 2) if args.quick else (DIM, DEPTH)
    rows = [r for ranks in h.spawn(worker, WORLD, shape) for r in ranks]
    for r in rows:
        r.update(ppo_bytes=r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"], model_dim=shape[0],
                 model_depth=shape[1], global_batch=GLOBAL_BATCH, num_microbatches=MICROBATCHES)  # fmt: skip
    rows = with_predictions(sorted(rows, key=lambda r: (list(RUNS).index(r["run"]), r["rank"])), shape)
    h.write_csv(args.out_dir / "fsdp_memory.csv", rows, COLUMNS)
    plot(args.out_dir / "fsdp_memory.png", rows)
    for run in RUNS:
        ranks = [r for r in rows if r["run"] == run]
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        ppo = max(ranks, key=lambda r: r["ppo_bytes"])
        print(f"{run:<15} params+grads+AdamW (max) {ppo['ppo_bytes'] / 2**20:7.2f} MiB "
              f"({ppo['ppo_vs_ddp']:.3f}x DDP)  peak {worst['peak_bytes'] / 2**20:7.2f} MiB "
              f"({worst['peak_vs_ddp']:.3f}x DDP), predicted {worst['predicted_error']:+.1%}")  # fmt: skip
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
