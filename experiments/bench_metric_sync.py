"""Cost of synchronising K logged scalars per step: AllReducedMetrics vs ``sync_dist=True`` vs no sync.

Runs one ``ddp_spawn`` fit per (mode, K) on CPU/gloo and records, on rank 0, the Python-level
collectives per training step (all_reduce, all_gather, all_gather_object, barrier; not the SIGTERM
``broadcast`` Lightning 2.6.6 makes every step anyway, nor DDP's C++ gradient all-reduce) and the
median step time. Writes ``experiments/results/metric_sync.csv`` and ``.png``.

Usage::

    python experiments/bench_metric_sync.py            # K = 1 8 32 128, 2 processes, a few minutes
    python experiments/bench_metric_sync.py --ks 1 32 --steps 40
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mp_harness import ddp_spawn  # noqa: E402

from lightning_parallel import AllReducedMetrics  # noqa: E402

_COUNTED = ("all_reduce", "all_gather", "all_gather_object", "barrier", "broadcast_object_list")


class Bench(L.LightningModule):
    def __init__(self, k: int, sync_dist: bool, out: str) -> None:
        super().__init__()
        self.k, self.sync_dist, self.out = k, sync_dist, out
        self.net = nn.Linear(32, 1)
        self.calls = [0]
        self.samples: list[tuple[float, int]] = []

    def on_train_start(self) -> None:
        for name in _COUNTED:
            fn = getattr(dist, name)

            def counted(*a, _fn=fn, **kw):
                self.calls[0] += 1
                return _fn(*a, **kw)

            setattr(dist, name, counted)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._t, self._c = time.perf_counter(), self.calls[0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log_dict({f"m{i:03d}": loss.detach() + i for i in range(self.k)}, sync_dist=self.sync_dist)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # The sync runs after this hook: close the previous step's window here instead.
        if getattr(self, "_prev", None) is not None:
            t0, c0 = self._prev
            self.samples.append((time.perf_counter() - t0, self.calls[0] - c0))
        self._prev = (self._t, self._c)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            torch.save(self.samples, self.out)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(mode: str, k: int, steps: int, devices: int) -> dict[str, float]:
    data = TensorDataset(torch.randn(steps * devices * 8, 32), torch.randn(steps * devices * 8, 1))
    # Under the repository, not /tmp: the spawned ranks write here while the parent waits.
    with tempfile.TemporaryDirectory(dir=ROOT / "experiments" / "results") as tmp:
        out = os.path.join(tmp, "samples.pt")
        callbacks = [AllReducedMetrics()] if mode == "all_reduced_metrics" else []
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=ddp_spawn(),
            max_epochs=1,
            log_every_n_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        trainer.fit(Bench(k, mode == "sync_dist", out), DataLoader(data, batch_size=8))
        samples = torch.load(out)[5:]  # skip warm-up (and the key-set agreement of step 0)
    times, calls = zip(*samples)
    return {"step_ms": 1e3 * statistics.median(times), "collectives_per_step": statistics.median(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32, 128], help="metrics per step")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--devices", type=int, default=2, help="processes")
    parser.add_argument(
        "--out",
        default=str(ROOT / "experiments" / "results" / "metric_sync"),
        help="output path without extension (.csv and .png are written)",
    )
    args = parser.parse_args()
    rows = []
    for k in args.ks:
        base = run("none", k, args.steps, args.devices)
        for mode in ("all_reduced_metrics", "sync_dist"):
            r = run(mode, k, args.steps, args.devices)
            overhead = r["step_ms"] - base["step_ms"]
            rows.append(
                {
                    "k": k,
                    "mode": mode,
                    "collectives_per_step": r["collectives_per_step"],
                    "step_ms": round(r["step_ms"], 3),
                    "no_sync_step_ms": round(base["step_ms"], 3),
                    "overhead_ms": round(overhead, 3),
                }
            )
            print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out + ".png")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("all_reduced_metrics", "sync_dist"):
        sel = [r for r in rows if r["mode"] == mode]
        ks = [r["k"] for r in sel]
        a.plot(ks, [r["collectives_per_step"] for r in sel], "o-", label=mode)
        b.plot(ks, [r["overhead_ms"] for r in sel], "o-", label=mode)
    for ax, title in ((a, "collectives per step"), (b, "step-time overhead vs no sync (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("scalar metrics logged per step (K)")
        ax.set_title(title)
        ax.legend()
    a.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
