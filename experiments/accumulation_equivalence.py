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

Every run is a fit in fresh processes started by the harness (gloo, spawn; one process for the
1-device runs), each rank's record brought back through a file. A correctness experiment: no timing.

Usage::

    python experiments/accumulation_equivalence.py            # about a minute on 2 cores
    python experiments/accumulation_equivalence.py --quick
"""

from __future__ import annotations

import argparse
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from typing_extensions import override

from lightning_parallel import GradientAccumulationScheduler


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

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float]] = []
        self._sum = 0.0

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sum += float(outputs["loss"])
        if len(self.rows) < trainer.global_step:  # this batch ended a window
            self.rows.append((trainer.global_step - 1, trainer.accumulate_grad_batches, self._sum))
            self._sum = 0.0


def make_data(n: int, d_in: int, d_out: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d_in, generator=g)
    w1, w2 = torch.randn(d_in, d_out, generator=g), torch.randn(d_in, d_out, generator=g)
    return TensorDataset(x, torch.tanh(x @ w1) + 0.3 * (x @ w2) + 0.05 * torch.randn(n, d_out, generator=g))


def fit_worker(rank: int, world: int, args: argparse.Namespace, schedule: Any, per_device: int) -> dict:
    """One rank of a fit at global batch ``schedule``: its per-step losses and its final parameters."""
    dataset = make_data(args.samples, args.d_in, args.d_out)
    if world == 1:  # the permutation Lightning's injected sampler uses, seen by one replica
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=per_device, sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=per_device)
    torch.manual_seed(0)
    model = Regressor(args.d_in, args.hidden, args.d_out, args.lr)
    steps = StepLoss()
    callbacks = [GradientAccumulationScheduler(global_batch_size=schedule), steps]
    trainer = h.quiet_trainer(
        devices=world, strategy="ddp" if world > 1 else "auto", max_epochs=args.epochs, callbacks=callbacks
    )
    trainer.fit(model, loader)
    return {"rows": steps.rows, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def run(args: argparse.Namespace, devices: int, schedule: Any, per_device: int) -> dict[str, Any]:
    """Fit on ``devices`` processes; the per-step mean loss over ranks, and rank 0's parameters."""
    records = h.spawn(fit_worker, devices, args, schedule, per_device)
    losses = [sum(rec["rows"][i][2] for rec in records) / devices for i in range(len(records[0]["rows"]))]
    factors = [row[1] for row in records[0]["rows"]]
    return {"losses": losses, "factors": factors, "params": records[0]["params"]}


def global_batch_at(schedule: Any, step: int) -> int:
    if isinstance(schedule, int):
        return schedule
    return schedule[max(k for k in schedule if k <= step)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = h.parser(__doc__.split("\n\n")[0], repeats=None)
    p.add_argument("--devices", type=int, default=2, help="processes of the N-device runs (default 2)")
    p.add_argument("--per-device-batch", type=int, default=8, help="per-device batch of the N-device runs")
    p.add_argument("--global-batch", type=int, default=64, help="global batch of the constant runs")
    p.add_argument(
        "--ramp", default="0:32,60:128", help="global batch ramp 'step:size,...' (default 0:32,60:128)"
    )
    p.add_argument("--samples", type=int, default=4000, help="data set size (default 4000)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--d-in", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--d-out", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.epochs, args.ramp = 128, 1, "0:32,2:64"  # 2 steps of 64; 2 of 32, then 1 of 64
    return args


def write_rows(path: Any, runs: dict[str, tuple[int, Any, dict]]) -> None:
    rows = [
        dict(run=name, devices=devices, step=step, global_batch_size=global_batch_at(schedule, step))
        | dict(accumulate_grad_batches=factor, loss=f"{loss:.8g}")
        for name, (devices, schedule, result) in runs.items()
        for step, (loss, factor) in enumerate(zip(result["losses"], result["factors"]))
    ]
    h.write_csv(path, rows)


# ------------------------------------------------------------------- its tables in docs/results.md


def accumulation_equivalence(rows: t.Rows) -> str:
    runs = t.groups(rows, "run")
    body = []
    for run, steps in runs.items():
        # Compare with the 1-device run of the same batch schedule: "2dev-ramp" -> "1dev-ramp".
        ref = runs.get("1dev-" + run.split("-", 1)[-1])
        diff = max(abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(steps, ref or steps))
        batch = f"{steps[0]['global_batch_size']} .. {steps[-1]['global_batch_size']}"
        body.append(
            [
                run,
                steps[0]["devices"],
                len(steps),
                batch,
                t.fixed(steps[0]["loss"], 4),
                t.fixed(steps[-1]["loss"], 4),
                f"{diff:.1e}" if ref is not None and ref is not steps else "-",
            ]
        )
    header = ["run", "devices", "optimizer steps", "global batch", "first loss", "final loss"]
    return t.table([*header, "max loss diff vs one device (CSV's 8-digit losses)"], body)


RESULTS = t.Results(
    "accumulation_equivalence",
    t.Section(
        "Gradient accumulation: one device against several at the same global batch",
        t.Table(accumulation_equivalence, ("loss",)),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    h.record_machine("accumulation_equivalence", args.out_dir)
    ramp = {int(k): int(v) for k, v in (item.split(":") for item in args.ramp.split(","))}
    n, b = args.devices, args.per_device_batch
    runs = {
        "1dev-const": (1, args.global_batch, run(args, 1, args.global_batch, args.global_batch)),
        f"{n}dev-const": (n, args.global_batch, run(args, n, args.global_batch, b)),
        "1dev-ramp": (1, ramp, run(args, 1, ramp, min(ramp.values()))),
        f"{n}dev-ramp": (n, ramp, run(args, n, ramp, b)),
    }
    write_rows(args.out_dir / "accumulation_equivalence.csv", runs)
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
    plot(runs, n, ramp, summary, args.out_dir / "accumulation_equivalence.png")


def plot(runs: dict, n: int, ramp: dict[int, int], summary: list[str], path: Any) -> None:
    fig, axes = h.figure(2, size=(12, 4.5))
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
    h.save_figure(fig, path)


if __name__ == "__main__":
    main()
