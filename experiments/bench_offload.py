"""Offload on this machine: step time with and without it, the host step's share, fused against foreach.

Two measurements, each of interleaved repeats in one process (one thread):

1. **Step time** of the byte-level LM (``models.SequentialCharLM``, width 128, 4 blocks, AdamW, batch 16
   of 64 bytes, 4 micro-batches) under ``PipelineStrategy(pipeline_size=1)`` on one device, four ways:

   - ``device``: no offload; the user's AdamW as built (torch's default CPU implementation: the loop);
   - ``device, fused``: no offload, AdamW(fused=True): what the host step runs, without the copies;
   - ``offload optimizer``: ``offload="optimizer"`` (host copies of the weights, the fused host step,
     the gradients in and the weights out once per step);
   - ``offload optimizer+activations``: and every micro-batch's saved tensors on the host.

   The ratio is each variant's median step over ``device``'s in the same repeat; the host step's share is
   the time ``step()`` spends after the closure (gradients in, the host kernel, weights out:
   ``HostStepping.seconds``) over the step. On this CPU-only machine host and device are the same
   memory: the copies are real but cost a memcpy, not a PCIe transfer, and no device memory is saved;
   what it shows is the control path's cost and the kernel's. A GPU's numbers need ``gpu_check.py``.
2. **The rungs beside it**, the same model in twice the steps, two more comparisons of interleaved repeats:

   - FSDP2 stages (``data_parallel="fsdp"``, one shard: one process) without offload, with
     ``offload="optimizer"`` (the shards on the device, their AdamW state and step on the host) and with
     ``offload="parameters"`` (FSDP2's ``CPUOffloadPolicy``: the shards, their gradients and the state on
     the host, copied up for each all-gather); the ratio is over ``fsdp2``'s step in the same repeat;
   - the disk tier (``offload_to="disk"``: the state in files under a temporary directory on this
     machine's disk, streamed through a host buffer of ``--disk-buffer``, 2 MiB by default: a few chunks)
     against host offload (``offload="optimizer"``); the ratio is over host offload's step.

   Each row has what the offload keeps on the host, measured at the end of the fit by walking its tensors
   (host offload: the weight copies, gradient buffers and state; ``CPUOffloadPolicy``: the shards and the
   state; the disk tier: its host buffers at their peak, ``HostBuffers.peak``, and its files'
   bytes), the disk tier's time waiting on the disk (the reads and writes its step did not hide), and
   the planner's prediction for the same plan (``estimate_memory``: the device peak, the host and disk
   bytes).
3. **The host kernel**: one AdamW (and SGD with momentum) step over the same model's parameters on host
   tensors, fused, foreach and the loop (``torch.optim``'s three implementations): why offload's host
   step takes the fused kernel first (``techniques/offload/host_optimizer.py: HOST_KERNELS``).

The planner's question (the largest model that trains on a 24 GiB and an 80 GiB device per rank, with and
without offload) comes with its offload rows (the memory planner's, issue 42 item 4), not here.

Writes ``offload.csv``, ``offload_tiers.csv``, ``offload_kernels.csv`` and ``offload.png`` under
``--out-dir``.

Usage::

    python experiments/bench_offload.py            # about 3 minutes on 2 quiet cores
    python experiments/bench_offload.py --quick    # width 64, 2 blocks, one repeat: checks that it runs
"""

from __future__ import annotations

import tempfile
import time
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
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.disk_optimizer import DiskStepping
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping

SEQ_LEN, BATCH, MICROBATCHES, WARMUP = 64, 16, 4, 3
VARIANTS = {  # name -> (offload, AdamW fused)
    "device": (None, False),
    "device, fused": (None, True),
    "offload optimizer": ("optimizer", False),
    "offload optimizer+activations": (["optimizer", "activations"], False),
}
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
KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
OPTIMIZERS = {
    "AdamW": lambda params, kernel: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kernel),
    "SGD": lambda params, kernel: torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kernel),
}


class LM(SequentialCharLM):
    """The benchmark's model: AdamW built fused or as torch defaults it."""

    def __init__(self, dim: int, depth: int, fused: bool) -> None:
        super().__init__(dim=dim, depth=depth, seq_len=SEQ_LEN)
        self.fused = fused

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, fused=self.fused or None)


class HostShare(L.Callback):
    """The host step's seconds after the warm-up steps (``HostStepping.seconds``), and what offload holds."""

    def __init__(self) -> None:
        self.at_warmup, self.at_end, self.held = 0.0, 0.0, {}

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if trainer.global_step == WARMUP:
            self.at_warmup = _host_seconds(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_end = _host_seconds(trainer)
        optimizer = trainer.optimizers[0]
        contexts = trainer.strategy.parts.runner.step_contexts
        hooks = next((c for c in contexts if isinstance(c, ActivationOffload)), None)
        self.held = optimizer.host_bytes() if is_host_stepping(optimizer) else {}
        if isinstance(hooks, ActivationOffload):
            self.held["activations_peak"] = hooks.peak_bytes


def _host_seconds(trainer: L.Trainer) -> float:
    optimizer = trainer.optimizers[0]
    return sum(optimizer.seconds.values()) if is_host_stepping(optimizer) else 0.0


def timed_fit(variant: str, shape: tuple[int, int], steps: int) -> dict[str, float]:
    offload, fused = VARIANTS[variant]
    torch.manual_seed(0)
    clock, share = h.StepClock(), HostShare()
    strategy = PipelineStrategy(pipeline_size=1, num_microbatches=MICROBATCHES, offload=offload)
    trainer = h.quiet_trainer(devices=1, strategy=strategy, max_steps=steps, callbacks=[clock, share])
    data = ByteWindows.of_stdlib((steps + 1) * BATCH, SEQ_LEN)
    trainer.fit(LM(*shape, fused=fused), DataLoader(data, batch_size=BATCH, drop_last=True))
    step_ms = clock.median_step_ms(warmup=WARMUP)
    host_ms = 1e3 * (share.at_end - share.at_warmup) / (steps - WARMUP)
    held = {f"host_{k}_bytes": v for k, v in share.held.items()}
    return {"step_ms": step_ms, "host_step_ms": host_ms, "host_share": host_ms / step_ms, **held}


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
    return {"step_ms": step_ms, "disk_wait_share": wait_ms / step_ms, "host_bytes": held.host,
            "disk_bytes": held.disk}  # fmt: skip


def planned(variant: str, shape: tuple[int, int], directory: str) -> dict[str, int]:
    """The planner's prediction for the variant's plan: the device peak, the host and the disk bytes."""
    torch.manual_seed(0)
    batch = next(iter(DataLoader(ByteWindows.of_stdlib(BATCH, SEQ_LEN), batch_size=BATCH)))
    est = estimate_memory(LM(*shape, fused=False), batch, strategy=_tier_strategy(variant, directory))
    return {"planned_device_peak_bytes": est.peak, "planned_host_bytes": est.host,
            "planned_disk_bytes": est.disk}  # fmt: skip


def tier_rows(shape: tuple[int, int], steps: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as directory:
        for comparison in dict.fromkeys(c for c, _ in TIERS.values()):
            names = [n for n, (c, _) in TIERS.items() if c == comparison]
            variants = {n: (lambda n=n: timed_tier(n, shape, steps, directory)) for n in names}
            samples = h.interleave(variants, repeats=repeats, warmup=True)
            for row in h.compare(samples, "step_ms", baseline=names[0]):
                mine = [s for s in samples if s["variant"] == row["variant"]]
                row |= h.spread(s["disk_wait_share"] for s in mine).cells("disk_wait_share", 4)
                row |= {"comparison": comparison, "baseline": names[0], "host_bytes": mine[-1]["host_bytes"],
                        "disk_bytes": mine[-1]["disk_bytes"], **planned(row["variant"], shape, directory),
                        "disk_buffer_bytes": DISK_BUFFER, "model_dim": shape[0], "model_depth": shape[1],
                        "batch": BATCH, "microbatches": MICROBATCHES}  # fmt: skip
                rows.append(row)
    return rows


def timed_kernel(name: str, kernel: dict[str, bool], params: list[torch.Tensor], steps: int) -> float:
    optimizer = OPTIMIZERS[name](params, kernel)
    optimizer.step()  # (the state is allocated at the first step)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return 1e3 * (time.perf_counter() - start) / steps


def step_rows(shape: tuple[int, int], steps: int, repeats: int) -> list[dict[str, Any]]:
    variants = {name: (lambda name=name: timed_fit(name, shape, steps)) for name in VARIANTS}
    samples = h.interleave(variants, repeats=repeats, warmup=True)
    rows = h.compare(samples, "step_ms", baseline="device")
    for row in rows:
        mine = [s for s in samples if s["variant"] == row["variant"]]
        row |= h.spread(s["host_share"] for s in mine).cells("host_share", 4)
        row["host_step_ms"] = round(h.spread(s["host_step_ms"] for s in mine).median, 3)
        for key in ("host_copies_bytes", "host_state_bytes", "host_activations_peak_bytes"):
            row[key] = mine[-1].get(key, "")
        row |= dict(model_dim=shape[0], model_depth=shape[1], batch=BATCH, microbatches=MICROBATCHES)
    return rows


def kernel_rows(shape: tuple[int, int], steps: int, repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = LM(*shape, fused=False)
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    rows = []
    for name in OPTIMIZERS:
        variants = {
            k: (lambda k=k, name=name: timed_kernel(name, KERNELS[k], params, steps)) for k in KERNELS
        }
        samples = h.interleave(variants, repeats=repeats, warmup=True)
        for row in h.compare([{**s, "step_ms": s["value"]} for s in samples], "step_ms", baseline="fused"):
            rows.append({"optimizer": name, "kernel": row.pop("variant"), **row,
                         "parameters": sum(p.numel() for p in params), "tensors": len(params)})  # fmt: skip
    return rows


STEP_COLUMNS = ["variant", "repeats", "step_ms", "step_ms_min", "step_ms_max", "ratio", "ratio_min",
                "ratio_max", "host_step_ms", "host_share", "host_share_min", "host_share_max",
                "host_copies_bytes", "host_state_bytes", "host_activations_peak_bytes", "model_dim",
                "model_depth", "batch", "microbatches"]  # fmt: skip
TIER_COLUMNS = ["comparison", "variant", "baseline", "repeats", "step_ms", "step_ms_min", "step_ms_max",
                "ratio", "ratio_min", "ratio_max", "disk_wait_share", "disk_wait_share_min",
                "disk_wait_share_max", "host_bytes", "disk_bytes", "planned_device_peak_bytes",
                "planned_host_bytes", "planned_disk_bytes", "disk_buffer_bytes", "model_dim", "model_depth",
                "batch", "microbatches"]  # fmt: skip
KERNEL_COLUMNS = ["optimizer", "kernel", "repeats", "step_ms", "step_ms_min", "step_ms_max", "ratio",
                  "ratio_min", "ratio_max", "parameters", "tensors"]  # fmt: skip


def plot(
    path: Any, steps: list[dict[str, Any]], tiers: list[dict[str, Any]], kernels: list[dict[str, Any]]
) -> None:
    fig, (left, middle, right) = h.figure(3, size=(17, 4.6))
    names = [r["variant"] for r in steps]
    h.errorbars(left, names, steps, "step_ms", fmt="o", color="tab:blue", label="step")
    shares = [float(r["host_share"]) * float(r["step_ms"]) for r in steps]
    left.bar(names, shares, color="tab:orange", alpha=0.6, label="of which the host step (after backward)")
    left.set(ylabel="ms per step (median, min-max)", title="One device, pipeline_size=1: step time")
    left.tick_params(axis="x", labelrotation=15)
    names = [r["variant"].replace(" (CPUOffloadPolicy)", "").replace("offload ", "") for r in tiers]
    h.errorbars(middle, names, tiers, "step_ms", fmt="o", color="tab:blue", label="step")
    middle.set(
        ylabel="ms per step (median, min-max)", title="FSDP2 with offload; the disk tier against the host"
    )
    middle.tick_params(axis="x", labelrotation=20)
    for name, colour in zip(OPTIMIZERS, ("tab:green", "tab:purple")):
        rows = [r for r in kernels if r["optimizer"] == name]
        h.errorbars(right, [r["kernel"] for r in rows], rows, "step_ms", fmt="o-", color=colour, label=name)
    right.set(ylabel="ms per optimizer step (median, min-max)", yscale="log",
              title=f"The host kernel: one step over {kernels[0]['parameters']:,} parameters")  # fmt: skip
    for ax in (left, middle, right):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def offload(rows: t.Rows) -> str:
    body = []
    for r in rows:
        words = {"higher_is_better": False, "words": ("faster", "slower")}
        ratio = (
            t.timed_col(r, "ratio", 3, t.ratio_verdict(r, "ratio", **words))
            if r["variant"] != "device"
            else "1"
        )
        share = t.timed_col(r, "host_share", 3) if r["host_copies_bytes"] else "-"
        held = ("host_copies_bytes", "host_state_bytes", "host_activations_peak_bytes")
        mib = [t.fixed(float(r[k]) / 2**20, 2) if r[k] else "-" for k in held]
        body.append([r["variant"], r["repeats"], t.timed_col(r, "step_ms", 1), ratio, share, *mib])
    header = ["variant", "repeats", "step ms", "vs device", "host step's share of the step"]
    header += ["host copies + gradient buffers MiB", "host AdamW state MiB", "activations on the host MiB"]
    r0 = rows[0]
    note = (
        f"\n\n`SequentialCharLM` width {r0['model_dim']}, {r0['model_depth']} blocks, AdamW, batch "
        f"{r0['batch']} in {r0['microbatches']} micro-batches, `PipelineStrategy(pipeline_size=1)` on one "
        "process (one thread); the ratio is taken within each repeat against `device` (the user's AdamW as "
        "torch builds it on a CPU: its loop implementation). The host step's share: what `step()` spends "
        "after the closure (gradients in, the host kernel, weights out) over the step. Host and device are "
        "the same memory on this machine: the copies cost a memcpy, and nothing leaves a device; how to "
        "read it: [Offload](offload.md)."
    )
    return t.table(header, body) + note


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
        body.append([r["variant"], r["repeats"], t.timed_col(r, "step_ms", 1), ratio, wait, *mib])
    header = ["variant", "repeats", "step ms", "vs the first of its group",
              "waiting on the disk, share of the step", "host MiB (measured)", "disk MiB (files)",
              "device peak MiB (planner)", "host MiB (planner)", "disk MiB (planner)"]  # fmt: skip
    buffer = t.fixed(float(rows[0]["disk_buffer_bytes"]) / 2**20, 2)
    note = (
        f"\n\nThe same model and batch as above, fits of twice the steps, one process: FSDP2 with one "
        f"shard, its ratio over `fsdp2` in each repeat; the disk tier (its files under a temporary "
        f"directory on this machine's disk, a host buffer of {buffer} MiB), its ratio over "
        "host offload in each repeat. Host MiB (measured): what the offload keeps on the host at the end of "
        "the fit, from its tensors (host offload: the weight copies, gradient buffers and AdamW state; "
        "`CPUOffloadPolicy`: the shards and the state; the disk tier: its host buffers at their peak, "
        "`HostBuffers.peak`). The planner's columns: `estimate_memory` of the same plan (the disk tier's "
        "step time is not modelled yet). How to read it: [Offload](offload.md)."
    )
    return t.table(header, body) + note


def offload_kernels(rows: t.Rows) -> str:
    body = []
    for r in rows:
        words = {"higher_is_better": False, "words": ("faster than fused", "slower than fused")}
        ratio = (
            t.timed_col(r, "ratio", 2, t.ratio_verdict(r, "ratio", **words))
            if r["kernel"] != "fused"
            else "1"
        )
        body.append([r["optimizer"], r["kernel"], r["repeats"], t.timed_col(r, "step_ms", 2), ratio])
    header = ["optimizer", "host kernel", "repeats", "ms per step", "vs fused"]
    return t.table(header, body) + (
        f"\n\nOne optimizer step over the same model's {rows[0]['parameters']} parameters "
        f"({rows[0]['tensors']} tensors) on host tensors, one thread: the order offload tries the host "
        "kernels in (fused, foreach, the loop)."
    )


RESULTS = t.Results(
    "offload",
    t.Section(
        "Offload: the optimizer step and the activations on the host, and the host kernel",
        t.Table(offload, ("step_ms", "ratio", "host_share", "host_copies_bytes")),
        t.Table(
            offload_tiers,
            (
                "step_ms",
                "ratio",
                "disk_wait_share",
                "host_bytes",
                "disk_bytes",
                "planned_device_peak_bytes",
                "planned_host_bytes",
                "planned_disk_bytes",
            ),
        ),
        t.Table(offload_kernels, ("step_ms", "ratio")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__).parse_args(argv)
    h.record_machine("offload", args.out_dir)
    h.quiet()
    start = time.perf_counter()
    shape, steps, repeats = ((64, 2), 5, 1) if args.quick else ((128, 4), 10, args.repeats)
    kernels = kernel_rows(shape, 3 if args.quick else 20, repeats)
    steps_rows = step_rows(shape, steps, repeats)
    tiers = tier_rows(shape, steps if args.quick else 2 * steps, repeats)  # (FSDP2's steps vary more)
    h.write_csv(args.out_dir / "offload.csv", steps_rows, STEP_COLUMNS)
    h.write_csv(args.out_dir / "offload_tiers.csv", tiers, TIER_COLUMNS)
    h.write_csv(args.out_dir / "offload_kernels.csv", kernels, KERNEL_COLUMNS)
    plot(args.out_dir / "offload.png", steps_rows, tiers, kernels)
    for r in steps_rows:
        print(f"{r['variant']:<31} step {r['step_ms']:8.1f} ms  x{r['ratio']:.3f} "
              f"({r['ratio_min']:.3f} .. {r['ratio_max']:.3f})  host step {r['host_share']:.1%}")  # fmt: skip
    for r in tiers:
        print(f"{r['variant']:<44} step {r['step_ms']:8.1f} ms  x{r['ratio']:.3f} "
              f"({r['ratio_min']:.3f} .. {r['ratio_max']:.3f}) of {r['baseline']}  host "
              f"{r['host_bytes'] / 2**20:.2f} MiB  disk {r['disk_bytes'] / 2**20:.2f} MiB")  # fmt: skip
    for r in kernels:
        print(f"{r['optimizer']:<6} {r['kernel']:<9} {r['step_ms']:8.2f} ms  x{r['ratio']:.2f} of fused")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
