"""Offload on this machine: step time with and without it, the host step's share, fused against foreach.

Four measurements, each of interleaved repeats (one thread):

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
2. **The rungs beside it** (``_offload_tiers.py``): FSDP2 stages without offload, with
   ``offload="optimizer"`` and with ``offload="parameters"`` (``CPUOffloadPolicy``), and the disk tier
   (``offload_to="disk"``, a 2 MiB buffer) against host offload, the same model in twice the steps: step
   times, what each keeps on the host and the disk by its tensors' count, the planner's prediction, and
   the disk's bandwidth measured where the files were.
3. **The host kernel**: one AdamW (and SGD with momentum) step over the same model's parameters on host
   tensors, fused, foreach and the loop (``torch.optim``'s three implementations): why offload's host
   step takes the fused kernel first (``techniques/offload/host_optimizer.py: HOST_KERNELS``).
4. **The host memory, measured** (``_offload_resident.py``): the process's resident memory around each
   optimizer step, a fresh process per fit, a wider model: no offload, host offload and the disk tier at
   a 2 MiB and a 16 MiB buffer, over an optimizer with no state in the same repeat.

The planner's question (the largest model that trains on a 24 GiB and an 80 GiB device per rank, with and
without offload) comes with its offload rows (the memory planner's, issue 42 item 4), not here.

Writes ``offload.csv``, ``offload_tiers.csv``, ``offload_kernels.csv``, ``offload_resident.csv`` and
``offload.png`` under ``--out-dir``.

Usage::

    python experiments/bench_offload.py            # about 8 minutes on 2 quiet cores
    python experiments/bench_offload.py --quick    # width 64, 2 blocks, one repeat: checks that it runs
"""

from __future__ import annotations

import time
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from _offload_resident import BASELINE, RESIDENT_COLUMNS, SHAPE, STEPS, offload_resident, resident_rows
from _offload_tiers import BATCH, LM, MICROBATCHES, SEQ_LEN, TIER_COLUMNS, WARMUP, offload_tiers, tier_rows
from models import ByteWindows
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel import PipelineStrategy
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping

VARIANTS = {  # name -> (offload, AdamW fused)
    "device": (None, False),
    "device, fused": (None, True),
    "offload optimizer": ("optimizer", False),
    "offload optimizer+activations": (["optimizer", "activations"], False),
}
KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
OPTIMIZERS = {
    "AdamW": lambda params, kernel: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kernel),
    "SGD": lambda params, kernel: torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kernel),
}


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


def timed_kernel(name: str, kernel: dict[str, bool], params: list[torch.Tensor], steps: int) -> float:
    optimizer = OPTIMIZERS[name](params, kernel)
    optimizer.step()  # (the state is allocated at the first step)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return 1e3 * (time.perf_counter() - start) / steps


def step_rows(shape: tuple[int, int], steps: int, repeats: int, warmup: bool = True) -> list[dict[str, Any]]:
    variants = {name: (lambda name=name: timed_fit(name, shape, steps)) for name in VARIANTS}
    samples = h.interleave(variants, repeats=repeats, warmup=warmup)
    rows = h.compare(samples, "step_ms", baseline="device")
    for row in rows:
        mine = [s for s in samples if s["variant"] == row["variant"]]
        row |= h.spread(s["host_share"] for s in mine).cells("host_share", 4)
        row["host_step_ms"] = round(h.spread(s["host_step_ms"] for s in mine).median, 3)
        for key in ("host_copies_bytes", "host_state_bytes", "host_activations_peak_bytes"):
            row[key] = mine[-1].get(key, "")
        row |= dict(model_dim=shape[0], model_depth=shape[1], batch=BATCH, microbatches=MICROBATCHES)
    return rows


def kernel_rows(
    shape: tuple[int, int], steps: int, repeats: int, warmup: bool = True
) -> list[dict[str, Any]]:
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
        samples = h.interleave(variants, repeats=repeats, warmup=warmup)
        for row in h.compare([{**s, "step_ms": s["value"]} for s in samples], "step_ms", baseline="fused"):
            rows.append({"optimizer": name, "kernel": row.pop("variant"), **row,
                         "parameters": sum(p.numel() for p in params), "tensors": len(params)})  # fmt: skip
    return rows


STEP_COLUMNS = ["variant", "repeats", "step_ms", "step_ms_min", "step_ms_max", "ratio", "ratio_min",
                "ratio_max", "host_step_ms", "host_share", "host_share_min", "host_share_max",
                "host_copies_bytes", "host_state_bytes", "host_activations_peak_bytes", "model_dim",
                "model_depth", "batch", "microbatches"]  # fmt: skip
KERNEL_COLUMNS = ["optimizer", "kernel", "repeats", "step_ms", "step_ms_min", "step_ms_max", "ratio",
                  "ratio_min", "ratio_max", "parameters", "tensors"]  # fmt: skip


def plot(
    path: Any,
    steps: list[dict[str, Any]],
    tiers: list[dict[str, Any]],
    kernels: list[dict[str, Any]],
    resident: list[dict[str, Any]],
) -> None:
    fig, (left, middle, right, memory) = h.figure(4, size=(22, 4.6))
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
    plot_resident(memory, resident)
    for ax in (left, middle, right, memory):
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    h.save_figure(fig, path)


def plot_resident(ax: Any, rows: list[dict[str, Any]]) -> None:
    names = [r["variant"].replace("offload optimizer ", "").replace(", ", "\n") for r in rows]
    for key, colour, what in (("later", "tab:blue", "a later step"), ("first", "tab:red", "the first step")):
        mib = [{k: float(v) / 2**20 for k, v in r.items() if k.startswith(f"{key}_step_over_baseline_bytes")}
               for r in rows]  # fmt: skip
        h.errorbars(ax, names, mib, f"{key}_step_over_baseline_bytes", fmt="o", color=colour, label=what)
    for r in rows:
        if float(r["buffer_bytes"]):
            ax.axhline(float(r["buffer_bytes"]) / 2**20, color="grey", ls=":", lw=1)
    ax.set(ylabel="MiB resident over the baseline (median, min-max)", yscale="log",
           title="The host's resident memory in a step (dotted: the buffers)")  # fmt: skip


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
                "disk_bandwidth",
            ),
        ),
        t.Table(offload_kernels, ("step_ms", "ratio")),
        t.Table(
            offload_resident,
            (
                "later_step_bytes",
                "later_step_over_baseline_bytes",
                "later_step_over_buffer",
                "first_step_bytes",
            ),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__).parse_args(argv)
    h.record_machine("offload", args.out_dir)
    h.quiet()
    start = time.perf_counter()
    shape, steps, repeats = ((64, 2), 5, 1) if args.quick else ((128, 4), 10, args.repeats)
    warmup = not args.quick  # (--quick: each fit once, a smoke run; its numbers are not read)
    kernels = kernel_rows(shape, 3 if args.quick else 20, repeats, warmup)
    steps_rows = step_rows(shape, steps, repeats, warmup)
    tiers = tier_rows(shape, steps if args.quick else 2 * steps, repeats, warmup)  # (FSDP2's vary more)
    # (--quick: the baseline and one disk tier, in one process: checks the path, not figures)
    quick_resident = (BASELINE, "on disk, 2 MiB buffer")
    resident = (
        resident_rows((64, 2), 3, repeats, quick_resident, one_process=True)
        if args.quick
        else resident_rows(SHAPE, STEPS, repeats)
    )
    h.write_csv(args.out_dir / "offload.csv", steps_rows, STEP_COLUMNS)
    h.write_csv(args.out_dir / "offload_tiers.csv", tiers, TIER_COLUMNS)
    h.write_csv(args.out_dir / "offload_kernels.csv", kernels, KERNEL_COLUMNS)
    h.write_csv(args.out_dir / "offload_resident.csv", resident, RESIDENT_COLUMNS)
    plot(args.out_dir / "offload.png", steps_rows, tiers, kernels, resident)
    for r in steps_rows:
        print(f"{r['variant']:<31} step {r['step_ms']:8.1f} ms  x{r['ratio']:.3f} "
              f"({r['ratio_min']:.3f} .. {r['ratio_max']:.3f})  host step {r['host_share']:.1%}")  # fmt: skip
    for r in tiers:
        print(f"{r['variant']:<44} step {r['step_ms']:8.1f} ms  x{r['ratio']:.3f} "
              f"({r['ratio_min']:.3f} .. {r['ratio_max']:.3f}) of {r['baseline']}  host "
              f"{r['host_bytes'] / 2**20:.2f} MiB  disk {r['disk_bytes'] / 2**20:.2f} MiB")  # fmt: skip
    for r in resident:
        print(f"{r['variant']:<31} resident over the baseline: a later step "
              f"{r['later_step_over_baseline_bytes'] / 2**20:.2f} MiB, the first "
              f"{r['first_step_over_baseline_bytes'] / 2**20:.2f} MiB")  # fmt: skip
    for r in kernels:
        print(f"{r['optimizer']:<6} {r['kernel']:<9} {r['step_ms']:8.2f} ms  x{r['ratio']:.2f} of fused")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
