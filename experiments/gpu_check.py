"""The CUDA/NCCL path in one short run, for a session that is lent a GPU machine.

Trains the main job's CharLM for a few steps under PipelineStrategy on the GPU(s) (NCCL when there are
several) and on one GPU without it, from the same seed and data, and prints the largest parameter
difference (fp32: expect ~1e-5 or less) and both throughputs. With one GPU the pipeline runs 2 stages on
that rank (interleaved_1f1b, stages_per_rank=2), which still exercises PipelineStage and the schedule
on CUDA. ``--accelerator cpu`` runs the same check here (gloo), which the test suite does not need.

    python experiments/gpu_check.py                  # all visible GPUs
    python experiments/gpu_check.py --accelerator cpu --devices 1
"""

from __future__ import annotations

import argparse
import time

import _harness as h
import lightning as L
import torch
from models import CharLM, StdlibText
from torch.utils.data import DataLoader

from lightning_parallel import PipelineStrategy


class FixedOrderText(StdlibText):
    """The main job's data in a fixed order: DDP-based strategies re-seed the RNG at set-up
    (Lightning's reset_seed), so a shuffled order would differ from the plain one-device run."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)


def train(strategy, devices: int, args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], float]:
    L.seed_everything(0, verbose=False)
    model = CharLM(dim=args.dim, depth=args.depth, seq_len=64, lr=1e-3)
    trainer = h.quiet_trainer(
        accelerator=args.accelerator, devices=devices, strategy=strategy, max_steps=args.steps,
        limit_val_batches=0, use_distributed_sampler=False,
    )  # fmt: skip
    data = FixedOrderText(seq_len=64, batch_size=args.batch_size, max_bytes=500_000)
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    return {
        k: v.detach().float().cpu() for k, v in model.state_dict().items()
    }, args.steps * args.batch_size / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() or 1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    args = p.parse_args()
    stages_per_rank = 2 if args.devices == 1 else 1
    schedule = "interleaved_1f1b" if stages_per_rank > 1 else "1f1b"
    pipe = PipelineStrategy(pipeline_size=args.devices, stages_per_rank=stages_per_rank, schedule=schedule)
    pipelined, pipe_rate = train(pipe, args.devices, args)
    reference, ref_rate = train("auto", 1, args)
    worst = max((pipelined[k] - reference[k]).abs().max().item() for k in reference)
    print(f"{args.accelerator} x{args.devices} {schedule}: max |param diff| vs one device = {worst:.2e}")
    print(f"samples/s: pipeline {pipe_rate:.1f}, one device without the strategy {ref_rate:.1f}")


if __name__ == "__main__":
    main()
