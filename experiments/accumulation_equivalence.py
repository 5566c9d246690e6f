"""Same global batch, same training: 1 device vs N devices with GradientAccumulationScheduler.

Trains one small MLP regressor four ways on CPU (gloo, spawn for N > 1):

* ``1dev-const``: 1 device, per-device batch = global batch, accumulation 1;
* ``Ndev-const``: N devices, small per-device batch, ``global_batch_size`` fixed (accumulation > 1);
* ``1dev-ramp`` / ``Ndev-ramp``: a ``global_batch_size`` warm-up ramp keyed by optimizer step.

Every run sees the same samples at every optimizer step (the 1-device loader uses the same
``DistributedSampler`` permutation as Lightning injects for N ranks), so the loss curves should lie on top
of each other and the final parameters agree to float32 rounding. Writes
``experiments/results/accumulation_equivalence.csv`` (run, devices, step, global_batch_size,
accumulate_grad_batches, loss) and ``.png`` (loss curves overlaid; the ramp with its global batch).

Usage::

    python experiments/accumulation_equivalence.py            # a few minutes on 2 cores
    python experiments/accumulation_equivalence.py --help
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel import GradientAccumulationScheduler
from lightning_parallel.strategies.launcher import CleanExitMultiProcessingLauncher

RESULTS = Path(__file__).resolve().parent / "results"


class SpawnDDP(DDPStrategy):
    """``ddp_spawn`` with the launcher that releases the process group when a worker ends."""

    def __init__(self) -> None:
        super().__init__(start_method="spawn")

    def _configure_launcher(self) -> None:
        self._launcher = CleanExitMultiProcessingLauncher(self, start_method=self._start_method)


class Regressor(L.LightningModule):
    def __init__(self, d_in: int, hidden: int, d_out: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class StepLoss(Callback):
    """Each optimizer step's loss on this rank: the sum of the weighted batch losses of its window.

    The scheduler scales each batch's returned loss to ``loss_i x n_i / N_window`` (after Lightning's
    division), so their sum over a window is the rank's sample-mean loss for that step.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: list[tuple[int, int, float]] = []
        self._sum = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sum += float(outputs["loss"])
        if len(self.rows) < trainer.global_step:  # this batch ended a window
            self.rows.append((trainer.global_step - 1, trainer.accumulate_grad_batches, self._sum))
            self._sum = 0.0

    def on_fit_end(self, trainer, pl_module) -> None:
        state = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
        record = {"rows": self.rows, "params": state}
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def make_data(n: int, d_in: int, d_out: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d_in, generator=g)
    w1, w2 = torch.randn(d_in, d_out, generator=g), torch.randn(d_in, d_out, generator=g)
    return TensorDataset(x, torch.tanh(x @ w1) + 0.3 * (x @ w2) + 0.05 * torch.randn(n, d_out, generator=g))


def run(args: argparse.Namespace, devices: int, global_batch_size: Any, per_device: int) -> dict[str, Any]:
    """Fit on ``devices`` processes; return the per-step mean loss over ranks and rank 0's parameters."""
    dataset = make_data(args.samples, args.d_in, args.d_out)
    if devices == 1:  # the permutation Lightning's injected sampler uses, seen by one replica
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=per_device, sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=per_device)
    torch.manual_seed(0)
    model = Regressor(args.d_in, args.hidden, args.d_out, args.lr)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=SpawnDDP() if devices > 1 else "auto",
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[GradientAccumulationScheduler(global_batch_size=global_batch_size), StepLoss(out_dir)],
        )
        trainer.fit(model, loader)
        records = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(devices)]
    losses = [sum(rec["rows"][i][2] for rec in records) / devices for i in range(len(records[0]["rows"]))]
    factors = [row[1] for row in records[0]["rows"]]
    return {"losses": losses, "factors": factors, "params": records[0]["params"]}


def global_batch_at(schedule: Any, step: int) -> int:
    if isinstance(schedule, int):
        return schedule
    return schedule[max(k for k in schedule if k <= step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="processes of the N-device runs (default 2)")
    parser.add_argument(
        "--per-device-batch", type=int, default=8, help="per-device batch of the N-device runs"
    )
    parser.add_argument("--global-batch", type=int, default=64, help="global batch of the constant runs")
    parser.add_argument(
        "--ramp",
        type=str,
        default="0:32,60:128",
        help="global batch ramp 'step:size,...' (default 0:32,60:128)",
    )
    parser.add_argument("--samples", type=int, default=4000, help="data set size (default 4000)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--d-in", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--d-out", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=RESULTS / "accumulation_equivalence", help="path stem")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ramp = {int(k): int(v) for k, v in (item.split(":") for item in args.ramp.split(","))}
    n, b = args.devices, args.per_device_batch

    runs = {
        "1dev-const": (1, args.global_batch, run(args, 1, args.global_batch, args.global_batch)),
        f"{n}dev-const": (n, args.global_batch, run(args, n, args.global_batch, b)),
        "1dev-ramp": (1, ramp, run(args, 1, ramp, min(ramp.values()))),
        f"{n}dev-ramp": (n, ramp, run(args, n, ramp, b)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "devices", "step", "global_batch_size", "accumulate_grad_batches", "loss"])
        for name, (devices, schedule, result) in runs.items():
            for step, (loss, factor) in enumerate(zip(result["losses"], result["factors"])):
                writer.writerow([name, devices, step, global_batch_at(schedule, step), factor, f"{loss:.8g}"])
    summary = []
    for kind in ("const", "ramp"):
        one, many = runs[f"1dev-{kind}"][2], runs[f"{n}dev-{kind}"][2]
        dloss = max(abs(a - c) for a, c in zip(one["losses"], many["losses"]))
        dparam = max((one["params"][k] - many["params"][k]).abs().max().item() for k in one["params"])
        summary.append(
            f"{kind}: {len(one['losses'])} vs {len(many['losses'])} steps, "
            f"max |loss diff| {dloss:.2e}, max |param diff| {dparam:.2e}"
        )
    print("\n".join(summary))
    plot(runs, n, ramp, summary, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.png')}")


def plot(runs: dict, n: int, ramp: dict[int, int], summary: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind, title in zip(axes, ("const", "ramp"), ("fixed global batch", f"global batch ramp {ramp}")):
        for name, style in ((f"1dev-{kind}", dict(lw=3, alpha=0.4)), (f"{n}dev-{kind}", dict(lw=1, ls="--"))):
            devices, _, result = runs[name]
            factors = sorted(set(result["factors"]))
            ax.plot(result["losses"], label=f"{devices} device(s), accumulate {factors}", **style)
        ax.set(xlabel="optimizer step", ylabel="training loss (step mean)", yscale="log", title=title)
        ax.legend(loc="lower left")
    sizes = [global_batch_at(ramp, s) for s in range(len(runs["1dev-ramp"][2]["losses"]))]
    twin = axes[1].twinx()
    twin.step(range(len(sizes)), sizes, color="grey", lw=1, where="post")
    twin.set_ylabel("global batch size", color="grey")
    fig.suptitle(" | ".join(summary), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
