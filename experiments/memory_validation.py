"""Does the memory planner predict what torch measures? Every prediction against MemTracker, rank by rank.

For each configuration (one device, as ``Trainer(devices=1)`` runs it: without DDP; DDP; pipelines
with p = 2 and 4; gpipe, 1f1b, interleaved; m in {2, 4, 8}; with and without recomputation; optimizer
state sharded or not; stages sharded with FSDP2 (2 pipeline ranks x 2 shards, and HSDP: 2 replicas x
2 shards); fp32 and bf16-mixed; the main job's GPT through the traced split and the same
network as an ``nn.Sequential``; offload of the optimizer, of FSDP2's shards and of the activations, where
the device peak plus the host bytes are compared, host and device being one memory here), the same
model, seed and batch are

- **predicted** by ``lightning_parallel.planner`` in this process (no training), and
- **measured** on every rank by torch's own meter, ``torch.distributed._tools.mem_tracker.MemTracker``,
  around one training step after a warm-up step (the optimizer state exists by then), under the real
  ``Trainer`` with gloo on CPU. The tracker counts every tensor an operator creates inside it, plus
  the tensors it is told of (``track_external``): the model, its gradients, the optimizer state (for a
  sharded one, the local optimizer it wraps), the batch, the pipeline's receive buffers (allocated
  at the first step, outside the tracked one), FSDP2's unsharded parameters (see
  ``_meters.fsdp_unsharded_params``) and an offloaded optimizer's host copies (``_meters.host_copies``);
  the meter is ``_meters.StepMeter``.

The tracker's module hooks are turned off (see ``_meters.blind_to_modules``): they refuse a module called
once per micro-batch, as a pipeline stage is ("does not support ... multiple iterative calls", torch 2.13),
and only attribute memory to modules; the peak is counted by the dispatch mode either way. Byte counts
do not depend on the machine's load: each configuration is measured once (no repeats).

Models: ``models.CharLM`` (the main job: a GPT with its head tied to the embedding, split by tracing)
and ``models.SequentialCharLM`` (the same network in one ``nn.Sequential``), width 128, 8 blocks, 64
bytes per sample, AdamW (``configure_optimizers`` needs a Trainer for its schedule, so the planner is
given the AdamW it builds); batch 16 per replica, 8 per rank under DDP.

Writes ``memory_validation.csv`` (one row per rank, each predicted component beside the measured peak)
and ``memory_validation.png`` (predicted against measured) under ``--out-dir``.

Usage::

    python experiments/memory_validation.py            # 32 configurations, ~6-12 minutes on 2 cores
    python experiments/memory_validation.py --quick    # 2 small configurations, ~1 minute
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from _meters import StepMeter
from hf_decoders import HFDecoderLM
from models import CharLM, SequentialCharLM
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import PipelineStrategy
from lightning_parallel.optim.sharded import local_state_bytes
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import MemoryEstimate, format_bytes, predict
from lightning_parallel.planner.facts import measure_model

TOLERANCE = 0.15

# ---------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Case:
    """One configuration: a ParallelPlan plus the model, its shape and the per-replica batch."""

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
    # "gpt": CharLM (traced split); "seq": SequentialCharLM (Sequential split); "hf-llama", "hf-gpt2":
    # a Hugging Face decoder called as self.model(input_ids=x) (experiments/hf_decoders.py)
    model: str = "gpt"
    batch: int = 16  # per replica
    dim: int = 128
    depth: int = 8
    seq_len: int = 64
    fsdp_shards: int = 0  # > 0: data_parallel="fsdp", the stages sharded over this many ranks (HSDP if fewer)
    tensor_parallel: int = 1  # > 1: model "seq-tp" (SequentialCharLM with separate q, k, v)
    offload: tuple[str, ...] = ()  # on this machine host and device are one memory: their total is compared

    def config(self) -> ParallelPlan:
        return ParallelPlan(
            self.strategy, self.devices, self.pipeline_size, self.num_microbatches, self.schedule,
            self.stages_per_rank, activation_checkpointing=self.checkpointing, precision=self.precision,
            **self.data_parallel(), tensor_parallel_size=self.tensor_parallel, offload=self.offload,
        )  # fmt: skip

    def data_parallel(self) -> dict[str, Any]:
        if not self.fsdp_shards:
            return dict(data_parallel="zero1") if self.sharded else {}
        return dict(data_parallel="fsdp", data_parallel_shard_size=self.fsdp_shards)


def cases(quick: bool) -> list[Case]:
    if quick:
        return [
            Case("ddp x2", "ddp", 2, batch=8, depth=4),
            Case("pp 2x1 1f1b m=4 +ac", "pipeline", 2, 2, 4, checkpointing=True, depth=4),
        ]
    pp = "pipeline"
    return [
        Case("single device", "single_device", 1, batch=8),
        Case("ddp x2", "ddp", 2, batch=8),
        Case("ddp x2 bf16", "ddp", 2, batch=8, precision="bf16-mixed"),
        Case("ddp x2 (Sequential)", "ddp", 2, batch=8, model="seq"),
        Case("pp 2x1 gpipe m=4", pp, 2, 2, 4, "gpipe"),
        Case("pp 2x1 1f1b m=2", pp, 2, 2, 2),
        Case("pp 2x1 1f1b m=4", pp, 2, 2, 4),
        Case("pp 2x1 1f1b m=8", pp, 2, 2, 8),
        Case("pp 2x1 1f1b m=4 +ac", pp, 2, 2, 4, checkpointing=True),
        Case("pp 2x1 1f1b m=4 bf16", pp, 2, 2, 4, precision="bf16-mixed"),
        Case("pp 2x1 interleaved m=4", pp, 2, 2, 4, "interleaved_1f1b", 2),
        Case("pp 4x1 1f1b m=8", pp, 4, 4, 8),
        Case("pp 4x1 gpipe m=4", pp, 4, 4, 4, "gpipe"),
        Case("pp 4x1 1f1b m=8 +ac bf16", pp, 4, 4, 8, checkpointing=True, precision="bf16-mixed"),
        Case("pp 2x2 1f1b m=4", pp, 4, 2, 4),
        Case("pp 2x2 1f1b m=4 +zero", pp, 4, 2, 4, sharded=True),
        Case("pp 1x4 1f1b m=4 +zero", pp, 4, 1, 4, sharded=True),
        Case("pp 2x1 1f1b m=4 (Sequential)", pp, 2, 2, 4, model="seq"),
        Case(
            "pp 2x1 interleaved m=8 +ac (Sequential)", pp, 2, 2, 8, "interleaved_1f1b", 2, True, model="seq"
        ),
        Case("pp 2x1 1f1b m=4 (HF Llama)", pp, 2, 2, 4, model="hf-llama"),
        Case("pp 2x1 interleaved m=4 (HF GPT-2)", pp, 2, 2, 4, "interleaved_1f1b", 2, model="hf-gpt2"),
        Case(
            "pp 2x2 1f1b m=4 +ac +zero (Sequential)",
            pp,
            4,
            2,
            4,
            checkpointing=True,
            sharded=True,
            model="seq",
        ),
        Case("pp 2x2 1f1b m=4 +fsdp (Sequential)", pp, 4, 2, 4, model="seq", fsdp_shards=2),
        Case("pp 2x2 1f1b m=4 +ac +fsdp (Sequential)", pp, 4, 2, 4, checkpointing=True, model="seq",
             fsdp_shards=2),
        Case("pp 1x4 1f1b m=4 +hsdp 2x2 (Sequential)", pp, 4, 1, 4, model="seq", fsdp_shards=2),
        Case("pp 2x1 1f1b m=4 tp=2 (Sequential)", pp, 4, 2, 4, model="seq-tp", tensor_parallel=2),
        Case("pp 1x1 1f1b m=2 tp=2 (Sequential)", pp, 2, 1, 2, model="seq-tp", tensor_parallel=2),
        Case("pp 2x1 1f1b m=4 tp=2 (HF Llama)", pp, 4, 2, 4, model="hf-llama", tensor_parallel=2),
        Case("pp 2x1 1f1b m=4 +offload opt", pp, 2, 2, 4, offload=("optimizer",)),
        Case("pp 1x2 1f1b m=2 +zero +offload opt", pp, 2, 1, 2, sharded=True, offload=("optimizer",)),
        Case("pp 2x1 1f1b m=4 +offload act", pp, 2, 2, 4, offload=("activations",)),
        Case("pp 1x2 1f1b m=2 +fsdp +offload param (Sequential)", pp, 2, 1, 2, model="seq",
             fsdp_shards=2, offload=("parameters",)),
    ]  # fmt: skip


def batch_for(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (case.batch, case.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def build_model(case: Case) -> L.LightningModule:
    torch.manual_seed(0)
    if case.model.startswith("hf-"):
        return HFDecoderLM(
            case.model.removeprefix("hf-"), dim=case.dim, depth=case.depth, seq_len=case.seq_len
        )
    if case.model == "seq-tp":
        return SequentialCharLM(dim=case.dim, depth=case.depth, seq_len=case.seq_len, split_qkv=True)
    cls = CharLM if case.model == "gpt" else SequentialCharLM
    return cls(dim=case.dim, depth=case.depth, seq_len=case.seq_len)


# ------------------------------------------------------------------------------------ measuring
# (StepMeter, and the private torch details it leans on: experiments/_meters.py)


def worker(rank: int, world: int, fields: dict[str, Any]) -> dict[str, Any]:
    """Two training steps on this rank, the second one tracked; this rank's measured bytes."""
    case = Case(**fields)
    meter = StepMeter()
    trainer = h.quiet_trainer(
        devices=world, strategy=_strategy(case), precision=case.precision, max_steps=2, callbacks=[meter]
    )
    x, y = batch_for(case)
    # Every rank reads the same batch each step, so the prediction's batch is each rank's batch.
    data = TensorDataset(x.repeat(2 * world, 1), y.repeat(2 * world, 1))
    trainer.fit(build_model(case), DataLoader(data, batch_size=case.batch))
    optimizer_state = local_state_bytes(trainer.optimizers[0])
    return {"rank": rank, "measured": meter.peak, "start": meter.start, "optimizer_state": optimizer_state}


def group_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`worker` for several configurations of the same world size, in order."""
    records = []
    for fields in cases:
        records.append(worker(rank, world, fields))
        gc.collect()  # the last fit's model and optimizer go before the next one's tracked step
    return records


def _strategy(case: Case) -> Any:
    if case.strategy in ("ddp", "single_device"):
        return "ddp" if case.strategy == "ddp" else "auto"  # auto on one device: no DDP wrapper
    return PipelineStrategy(
        pipeline_size=case.pipeline_size, num_microbatches=case.num_microbatches, schedule=case.schedule,
        stages_per_rank=case.stages_per_rank, activation_checkpointing=case.checkpointing,
        shard_optimizer_state=case.sharded, **case.data_parallel(), tensor_parallel_size=case.tensor_parallel,
        offload=list(case.offload) or None,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ comparing


def predicted(case: Case) -> MemoryEstimate:
    model = build_model(case)
    # configure_optimizers reads trainer.estimated_stepping_batches for its LR schedule: give the
    # planner the AdamW it builds instead (the state it keeps does not depend on the schedule).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    facts = measure_model(
        model, batch_for(case), case.precision, optimizer, tensor_parallel_size=case.tensor_parallel
    )
    return predict(facts, case.config())


def rows_for(case: Case, estimate: MemoryEstimate, measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    per_pp_rank = case.config().data_parallel_size * case.tensor_parallel
    rows = []
    for record in measured:
        rank = record["rank"]
        mine = estimate.ranks[rank // per_pp_rank if case.strategy == "pipeline" else 0]
        # With offload the device peak and the host bytes are one memory here: the meter sees both. The
        # micro-batch whose backward runs is, with its activations offloaded, its host copy itself here
        # (unpacking to the CPU copies nothing): counted once (one stage per rank in these cases).
        twice = mine.host // max(mine.in_flight) if "activations" in case.offload else 0
        predicted_bytes = mine.peak + mine.host - twice
        rows.append(
            dict(
                config=case.name, **{k: v for k, v in asdict(case).items() if k not in ("name", "offload")},
                offload=",".join(case.offload), rank=rank, measured_bytes=record["measured"],
                predicted_bytes=predicted_bytes, predicted_host=mine.host,
                error=round(predicted_bytes / record["measured"] - 1, 4),
                predicted_parameters=mine.parameters, predicted_gradients=mine.gradients,
                predicted_optimizer=mine.optimizer, predicted_activations=mine.activations,
                predicted_buffers=mine.buffers, predicted_gathered=mine.gathered,
                in_flight=",".join(map(str, mine.in_flight)),
                measured_optimizer_state=record["optimizer_state"], tracked_at_start=record["start"],
                tolerance=TOLERANCE,
            )
        )  # fmt: skip
    worst = max(rows, key=lambda r: r["measured_bytes"])
    for r in rows:
        r["worst_rank"] = r is worst
    return rows


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    fig, ax = h.figure(size=(7.5, 6.5))
    measured = [r["measured_bytes"] / 2**20 for r in rows]
    predicted_mib = [r["predicted_bytes"] / 2**20 for r in rows]
    top = max(measured + predicted_mib) * 1.08
    line = [0, top]
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    low, high = [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)]
    ax.fill_between(line, low, high, color="tab:green", alpha=0.12, label=f"within +/-{TOLERANCE:.0%}")
    for worst, colour, size, label in ((False, "tab:blue", 18, "other ranks"),
                                       (True, "tab:red", 34, "worst rank of a configuration")):  # fmt: skip
        pts = [(m, p) for m, p, r in zip(measured, predicted_mib, rows) if r["worst_rank"] == worst]
        ax.scatter([m for m, _ in pts], [p for _, p in pts], s=size, color=colour, alpha=0.8, label=label)
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured peak, MemTracker (MiB)",
           ylabel="predicted peak, estimate_memory (MiB)",
           title="Per-rank peak memory of one training step: predicted vs measured")  # fmt: skip
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    h.save_figure(fig, path)


def summary(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'configuration':<42} {'ranks':>5} {'measured':>11} {'predicted':>11} {'error':>7}  "
             f"{'furthest rank':>13}"]  # fmt: skip
    for name in dict.fromkeys(r["config"] for r in rows):
        ranks = [r for r in rows if r["config"] == name]
        w = next(r for r in ranks if r["worst_rank"])
        furthest = max(ranks, key=lambda r: abs(r["error"]))["error"]
        lines.append(
            f"{name:<42} {len(ranks):>5} {format_bytes(w['measured_bytes']):>11} "
            f"{format_bytes(w['predicted_bytes']):>11} {w['error']:>+7.1%}  {furthest:>+13.1%}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------- its tables in docs/results.md


def memory_validation(rows: t.Rows) -> str:
    body = []
    for config, ranks in t.groups(rows, "config").items():
        worst = next(r for r in ranks if r["worst_rank"] == "True")
        furthest = max(ranks, key=lambda r: abs(float(r["error"])))
        mib = [t.mib(float(worst[k])) for k in ("measured_bytes", "predicted_bytes")]
        body.append([config, len(ranks), *mib, t.fixed(worst["error"], 3), t.fixed(furthest["error"], 3)])
    header = ["run", "ranks", "measured MiB, worst rank (MemTracker)", "predicted MiB", "error"]
    return t.table([*header, "error, furthest rank"], body) + (
        f"\n\nerror = predicted / measured - 1, target |error| <= {rows[0]['tolerance']} on the worst rank "
        "(the rank with the largest measured peak). Byte counts do not depend on the load: measured once."
    )


RESULTS = t.Results(
    "memory_validation",
    t.Section(
        "Will it fit? The memory planner's prediction against MemTracker, rank by rank",
        t.Table(memory_validation, ("measured_bytes", "predicted_bytes", "error")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, repeats=None)
    p.add_argument("--only", nargs="*", help="run only the configurations with these names")
    args = p.parse_args(argv)
    h.record_machine("memory_validation", args.out_dir)
    h.quiet()
    start = time.perf_counter()
    chosen = [c for c in cases(args.quick) if not args.only or c.name in args.only]
    measured: dict[str, list[dict[str, Any]]] = {}
    for devices in dict.fromkeys(c.devices for c in chosen):
        # One set of processes per world size, measuring its configurations one after the other:
        # MemTracker counts the tensors of the tracked step only, whatever earlier fits left behind.
        group = [c for c in chosen if c.devices == devices]
        print(f"measuring {', '.join(c.name for c in group)} ...", flush=True)
        per_rank = h.spawn(group_worker, devices, [asdict(c) for c in group])
        for i, case in enumerate(group):
            measured[case.name] = [records[i] for records in per_rank]
    rows: list[dict[str, Any]] = []
    for case in chosen:
        rows += rows_for(case, predicted(case), measured[case.name])
    h.write_csv(args.out_dir / "memory_validation.csv", rows)
    plot(args.out_dir / "memory_validation.png", rows)
    print(summary(rows))
    bad = [r for r in rows if r["worst_rank"] and abs(r["error"]) > TOLERANCE]
    print(f"{len(rows)} ranks in {time.perf_counter() - start:.0f} s; worst-rank errors beyond "
          f"+/-{TOLERANCE:.0%}: {len(bad)}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
