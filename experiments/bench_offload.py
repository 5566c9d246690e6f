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
2. **The host kernel**: one AdamW (and SGD with momentum) step over the same model's parameters on host
   tensors, fused, foreach and the loop (``torch.optim``'s three implementations): why offload's host
   step takes the fused kernel first (``techniques/offload/host_optimizer.py: HOST_KERNELS``).

The planner's question (the largest model that trains on a 24 GiB and an 80 GiB device per rank, with and
without offload) comes with its offload rows (the memory planner's, issue 42 item 4), not here.

Writes ``offload.csv``, ``offload_kernels.csv`` and ``offload.png`` under ``--out-dir``.

Usage::

    python experiments/bench_offload.py            # about 2 minutes on 2 cores
    python experiments/bench_offload.py --quick    # width 64, 2 blocks, one repeat: checks that it runs
"""

from __future__ import annotations

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
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping

SEQ_LEN, BATCH, MICROBATCHES, WARMUP = 64, 16, 4, 3
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
KERNEL_COLUMNS = ["optimizer", "kernel", "repeats", "step_ms", "step_ms_min", "step_ms_max", "ratio",
                  "ratio_min", "ratio_max", "parameters", "tensors"]  # fmt: skip


def plot(path: Any, steps: list[dict[str, Any]], kernels: list[dict[str, Any]]) -> None:
    fig, (left, right) = h.figure(2, size=(12, 4.6))
    names = [r["variant"] for r in steps]
    h.errorbars(left, names, steps, "step_ms", fmt="o", color="tab:blue", label="step")
    shares = [float(r["host_share"]) * float(r["step_ms"]) for r in steps]
    left.bar(names, shares, color="tab:orange", alpha=0.6, label="of which the host step (after backward)")
    left.set(ylabel="ms per step (median, min-max)", title="One device, pipeline_size=1: step time")
    left.tick_params(axis="x", labelrotation=15)
    for name, colour in zip(OPTIMIZERS, ("tab:green", "tab:purple")):
        rows = [r for r in kernels if r["optimizer"] == name]
        h.errorbars(right, [r["kernel"] for r in rows], rows, "step_ms", fmt="o-", color=colour, label=name)
    right.set(ylabel="ms per optimizer step (median, min-max)", yscale="log",
              title=f"The host kernel: one step over {kernels[0]['parameters']:,} parameters")  # fmt: skip
    for ax in (left, right):
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
    h.write_csv(args.out_dir / "offload.csv", steps_rows, STEP_COLUMNS)
    h.write_csv(args.out_dir / "offload_kernels.csv", kernels, KERNEL_COLUMNS)
    plot(args.out_dir / "offload.png", steps_rows, kernels)
    for r in steps_rows:
        print(f"{r['variant']:<31} step {r['step_ms']:8.1f} ms  x{r['ratio']:.3f} "
              f"({r['ratio_min']:.3f} .. {r['ratio_max']:.3f})  host step {r['host_share']:.1%}")  # fmt: skip
    for r in kernels:
        print(f"{r['optimizer']:<6} {r['kernel']:<9} {r['step_ms']:8.2f} ms  x{r['ratio']:.2f} of fused")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
