"""The CUDA/NCCL path in one short run, for a session that is lent a GPU machine.

Trains the main job's CharLM for a few steps under PipelineStrategy on the GPU(s) (NCCL when there are
several) and on one GPU without it, from the same seed and data, and prints the largest parameter
difference (fp32: expect ~1e-5 or less) and both throughputs. With one GPU the pipeline is one stage
(pipeline_size=1: a traced forward cannot interleave two stages on one rank), which still exercises
PipelineStage and the schedule on CUDA. ``--accelerator cpu`` runs the same check here (gloo), which
the test suite does not need.

Then offload, the same way (against the same one-device run): the pipeline with its optimizer state and
step and its activations on the host (pinned on a GPU), and FSDP2 over every device (pipeline_size=1,
each rank the same batch) with its shards on the host (``offload="parameters"``: the process group gets
``cpu:gloo`` beside NCCL, and clipping reduces host gradients through it). Each rank prints its device
peak (``torch.cuda.max_memory_allocated``) beside the planner's device column for that plan.

    python experiments/gpu_check.py                  # all visible GPUs
    python experiments/gpu_check.py --accelerator cpu --devices 1
    python experiments/gpu_check.py --quick --accelerator cpu --devices 1   # tiny: checks that it runs
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
from lightning_parallel.distributed.dtensors import full_tensors


class FixedOrderText(StdlibText):
    """The main job's data in a fixed order: DDP-based strategies re-seed the RNG at set-up
    (Lightning's reset_seed), so a shuffled order would differ from the plain one-device run."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)


# TODO(issue 42, item 4): the memory planner's device column for each offload plan, once it has offload
# rows; until then the peaks are printed beside this placeholder.
PLANNER_DEVICE_COLUMN = "n/a (the planner's offload rows: issue 42 item 4)"


def train(strategy, devices: int, args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], float]:
    L.seed_everything(0, verbose=False)
    model = CharLM(dim=args.dim, depth=args.depth, seq_len=64, lr=1e-3)
    trainer = h.quiet_trainer(
        accelerator=args.accelerator, devices=devices, strategy=strategy, max_steps=args.steps,
        limit_val_batches=0, use_distributed_sampler=False, gradient_clip_val=1.0,
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    data = FixedOrderText(seq_len=64, batch_size=args.batch_size, max_bytes=args.text_bytes)
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    if isinstance(strategy, PipelineStrategy) and strategy.parallel_plan.offload:
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if torch.cuda.is_available() else "n/a"
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
        what = list(strategy.parallel_plan.offload)
        print(f"rank {trainer.global_rank} offload={what} (backend {backend}): device peak {peak}, "
              f"planner's device column {PLANNER_DEVICE_COLUMN}")  # fmt: skip
    state = full_tensors(model.state_dict())  # (FSDP2's shards gathered: every rank calls it)
    return {k: v.detach().float().cpu() for k, v in state.items()}, args.steps * args.batch_size / seconds


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__, repeats=None)  # (--out-dir: it writes no file)
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() or 1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--text-bytes", type=int, default=500_000)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.dim, args.depth, args.text_bytes = 2, 4, 32, 1, 20_000
    schedule = "1f1b"
    pipe = PipelineStrategy(pipeline_size=args.devices, schedule=schedule)
    pipelined, pipe_rate = train(pipe, args.devices, args)
    reference, ref_rate = train("auto", 1, args)
    worst = max((pipelined[k] - reference[k]).abs().max().item() for k in reference)
    print(f"{args.accelerator} x{args.devices} {schedule}: max |param diff| vs one device = {worst:.2e}")
    print(f"samples/s: pipeline {pipe_rate:.1f}, one device without the strategy {ref_rate:.1f}")
    offloaded = {
        f"{schedule} +offload optimizer,activations": PipelineStrategy(
            pipeline_size=args.devices, schedule=schedule, offload=["optimizer", "activations"]
        ),
        f"fsdp x{args.devices} +offload parameters": PipelineStrategy(
            pipeline_size=1, data_parallel="fsdp", offload="parameters"
        ),
    }  # fmt: skip
    for name, strategy in offloaded.items():
        params, rate = train(strategy, args.devices, args)
        worst = max((params[k] - reference[k]).abs().max().item() for k in reference)
        print(f"{args.accelerator} x{args.devices} {name}: max |param diff| vs one device = {worst:.2e}, "
              f"samples/s {rate:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
