"""Offload's rungs beside host offload, for ``bench_offload.py``: FSDP2 with and without offload, and the
disk tier against host offload, their step times, what they keep on the host and the disk, the planner's
prediction of the same plans, and the disk's bandwidth.

Two comparisons of interleaved repeats, each in one process (one thread), the model ``bench_offload.py``
times (:class:`LM`):

- FSDP2 stages (``data_parallel="fsdp"``, one shard: one process) without offload, with
  ``offload="optimizer"`` (the shards on the device, their AdamW state and step on the host) and with
  ``offload="parameters"`` (FSDP2's ``CPUOffloadPolicy``: the shards, their gradients and the state on
  the host, copied up for each all-gather); the ratio is over ``fsdp2``'s step in the same repeat;
- the disk tier (``offload_to="disk"``: the state in files under a temporary directory on this machine's
  disk, streamed through a host buffer of :data:`DISK_BUFFER`: a few chunks) against host offload
  (``offload="optimizer"``); the ratio is over host offload's step. Each disk run also measures the
  disk's bandwidth in that directory (``disk_rate.disk_bandwidth``: written through to the disk and
  dropped from the page cache before it is read back), the figure the planner charges the streaming at.

Each row has what the offload keeps on the host, counted at the end of the fit from its tensors (host
offload: the weight copies, gradient buffers and state; ``CPUOffloadPolicy``: the shards and the state;
the disk tier: its host buffers at their peak, ``HostBuffers.peak``; the process's resident memory is
``_offload_resident.py``'s), its files' bytes, the disk tier's time waiting on the disk (the reads and
writes its step did not hide), and the planner's prediction for the same plan (``estimate_memory``).

A helper module, not a script: nothing here runs at import time beyond definitions.
"""

from __future__ import annotations

import tempfile
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel import PipelineStrategy, estimate_memory
from lightning_parallel.distributed.dtensors import local
from lightning_parallel.techniques.offload.disk_optimizer import DiskStepping
from lightning_parallel.techniques.offload.disk_rate import disk_bandwidth
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping

SEQ_LEN, BATCH, MICROBATCHES, WARMUP = 64, 16, 4, 3
TIERS = {  # name -> (comparison, PipelineStrategy options); each comparison's first is its baseline
    "fsdp2": ("fsdp2", {"data_parallel": "fsdp"}),
    "fsdp2, offload optimizer": ("fsdp2", {"data_parallel": "fsdp", "offload": "optimizer"}),
    "fsdp2, offload parameters (CPUOffloadPolicy)": (
        "fsdp2",
        {"data_parallel": "fsdp", "offload": "parameters"},
    ),
    "offload optimizer (host)": ("disk", {"offload": "optimizer"}),
    "offload optimizer on disk": ("disk", {"offload": "optimizer", "offload_to": "disk"}),
}
DISK_BUFFER = 2 * 2**20


class LM(SequentialCharLM):
    """The benchmark's model: AdamW built fused or as torch defaults it."""

    def __init__(self, dim: int, depth: int, fused: bool) -> None:
        super().__init__(dim=dim, depth=depth, seq_len=SEQ_LEN)
        self.fused = fused

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, fused=self.fused or None)


class OffloadHeld(L.Callback):
    """At the end of training (before the strategy's teardown closes the disk tier): what the offload keeps
    on the host and on the disk, measured from its tensors, and the disk tier's seconds waiting."""

    def __init__(self) -> None:
        self.at_warmup, self.host, self.disk, self.waiting = 0.0, 0, 0, 0.0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if trainer.global_step == WARMUP:
            self.at_warmup = _waited(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.waiting = _waited(trainer) - self.at_warmup
        optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        if isinstance(optimizer, DiskStepping):
            self.host, self.disk = optimizer.buffers.peak, optimizer.disk_bytes()
        elif is_host_stepping(optimizer):
            self.host = sum(optimizer.host_bytes().values())
        elif "parameters" in trainer.strategy.parallel_plan.offload:  # (FSDP2's host shards and state)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            self.host = sum(local(t).nbytes for t in params + state)


def _waited(trainer: L.Trainer) -> float:
    optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
    return optimizer.seconds["waiting"] if isinstance(optimizer, DiskStepping) else 0.0


def _tier_strategy(variant: str, directory: str) -> PipelineStrategy:
    options = dict(TIERS[variant][1])
    if options.get("offload_to") == "disk":
        options |= {"offload_dir": directory, "offload_buffer": DISK_BUFFER}
    return PipelineStrategy(pipeline_size=1, num_microbatches=MICROBATCHES, **options)


def timed_tier(variant: str, shape: tuple[int, int], steps: int, directory: str) -> dict[str, float]:
    torch.manual_seed(0)
    clock, held = h.StepClock(), OffloadHeld()
    trainer = h.quiet_trainer(devices=1, strategy=_tier_strategy(variant, directory), max_steps=steps,
                              callbacks=[clock, held])  # fmt: skip
    data = ByteWindows.of_stdlib((steps + 1) * BATCH, SEQ_LEN)
    trainer.fit(LM(*shape, fused=False), DataLoader(data, batch_size=BATCH, drop_last=True))
    step_ms = clock.median_step_ms(warmup=WARMUP)
    wait_ms = 1e3 * held.waiting / (steps - WARMUP)
    # (after the fit, in the directory its files were in: the disk the planner would charge it at)
    rate = disk_bandwidth(directory) if held.disk else 0.0
    return {"step_ms": step_ms, "disk_wait_share": wait_ms / step_ms, "host_bytes": held.host,
            "disk_bytes": held.disk, "disk_bandwidth": rate}  # fmt: skip


def planned(variant: str, shape: tuple[int, int], directory: str) -> dict[str, int]:
    """The planner's prediction for the variant's plan: the device peak, the host and the disk bytes."""
    torch.manual_seed(0)
    batch = next(iter(DataLoader(ByteWindows.of_stdlib(BATCH, SEQ_LEN), batch_size=BATCH)))
    est = estimate_memory(LM(*shape, fused=False), batch, strategy=_tier_strategy(variant, directory))
    return {"planned_device_peak_bytes": est.peak, "planned_host_bytes": est.host,
            "planned_disk_bytes": est.disk}  # fmt: skip


def tier_rows(shape: tuple[int, int], steps: int, repeats: int, warmup: bool = True) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as directory:
        for comparison in dict.fromkeys(c for c, _ in TIERS.values()):
            names = [n for n, (c, _) in TIERS.items() if c == comparison]
            variants = {n: (lambda n=n: timed_tier(n, shape, steps, directory)) for n in names}
            samples = h.interleave(variants, repeats=repeats, warmup=warmup)
            for row in h.compare(samples, "step_ms", baseline=names[0]):
                mine = [s for s in samples if s["variant"] == row["variant"]]
                row |= h.spread(s["disk_wait_share"] for s in mine).cells("disk_wait_share", 4)
                row |= h.spread(s["disk_bandwidth"] for s in mine).cells("disk_bandwidth", 0)
                row |= {"comparison": comparison, "baseline": names[0], "host_bytes": mine[-1]["host_bytes"],
                        "disk_bytes": mine[-1]["disk_bytes"], **planned(row["variant"], shape, directory),
                        "disk_buffer_bytes": DISK_BUFFER, "model_dim": shape[0], "model_depth": shape[1],
                        "batch": BATCH, "microbatches": MICROBATCHES}  # fmt: skip
                rows.append(row)
    return rows


TIER_COLUMNS = ["comparison", "variant", "baseline", "repeats", "step_ms", "step_ms_min", "step_ms_max",
                "ratio", "ratio_min", "ratio_max", "disk_wait_share", "disk_wait_share_min",
                "disk_wait_share_max", "host_bytes", "disk_bytes", "planned_device_peak_bytes",
                "planned_host_bytes", "planned_disk_bytes", "disk_buffer_bytes", "disk_bandwidth",
                "disk_bandwidth_min", "disk_bandwidth_max", "model_dim", "model_depth", "batch",
                "microbatches"]  # fmt: skip


# ------------------------------------------------------------------- its table in docs/results.md

BYTES = ("host_bytes", "disk_bytes", "planned_device_peak_bytes", "planned_host_bytes", "planned_disk_bytes")


def offload_tiers(rows: t.Rows) -> str:
    body = []
    for r in rows:
        words = {"higher_is_better": False, "words": ("faster", "slower")}
        ratio = (
            t.timed_col(r, "ratio", 3, t.ratio_verdict(r, "ratio", **words))
            if r["variant"] != r["baseline"]
            else "1"
        )
        wait = t.timed_col(r, "disk_wait_share", 3) if float(r["disk_bytes"]) else "-"
        mib = [t.fixed(float(r[k]) / 2**20, 2) for k in BYTES]
        gbs = [float(r[k]) / 1e9 for k in ("disk_bandwidth", "disk_bandwidth_min", "disk_bandwidth_max")]
        rate = t.timed(*gbs, 2) if gbs[0] else "-"
        body.append([r["variant"], r["repeats"], t.timed_col(r, "step_ms", 1), ratio, wait, *mib, rate])
    header = ["variant", "repeats", "step ms", "vs the first of its group",
              "waiting on the disk, share of the step", "host MiB (its tensors)", "disk MiB (files)",
              "device peak MiB (planner)", "host MiB (planner)", "disk MiB (planner)",
              "the disk's bandwidth GB/s (measured)"]  # fmt: skip
    buffer = t.fixed(float(rows[0]["disk_buffer_bytes"]) / 2**20, 2)
    note = (
        f"\n\nThe same model and batch as above, fits of twice the steps, one process: FSDP2 with one "
        f"shard, its ratio over `fsdp2` in each repeat; the disk tier (its files under a temporary "
        f"directory on this machine's disk, a host buffer of {buffer} MiB), its ratio over "
        "host offload in each repeat. Host MiB (its tensors): what the offload keeps on the host at the end "
        "of the fit, counted from its tensors (host offload: the weight copies, gradient buffers and AdamW "
        "state; `CPUOffloadPolicy`: the shards and the state; the disk tier: its host buffers at their "
        "peak, `HostBuffers.peak`); the process's resident memory is measured in the next table. The "
        "planner's columns: `estimate_memory` of the same plan. The disk's bandwidth: one pass (a write or "
        "a read) over a 4 MiB file in the same directory, written through to the disk and dropped from the "
        "page cache before it is read (`disk_rate.disk_bandwidth`, what the planner charges the streaming "
        "at), measured after each disk run; the tier's own files, a few MiB, stay in the page cache, so "
        "its step time is the streaming's cost, not the disk's. How to read it: [Offload](offload.md)."
    )
    return t.table(header, body) + note
