"""The CUDA/NCCL path in one short run, for a session that is lent a GPU machine.

Trains the main job's CharLM for a few steps under PipelineStrategy on the GPU(s) (NCCL when there are
several) and on one GPU without it, from the same seed and data, and prints the largest parameter
difference (fp32: expect ~1e-5 or less) and both throughputs. With one GPU the pipeline is one stage
(pipeline_size=1: a traced forward cannot interleave two stages on one rank), which still exercises
PipelineStage and the schedule on CUDA. ``--accelerator cpu`` runs the same check here (gloo), which
the test suite does not need.

Then each technique whose CUDA path no CPU run exercises, the same way (against the same one-device
run), where the devices allow it (:data:`CHECKS`): offload (the optimizer state and step and the
activations on the host, pinned on a GPU; FSDP2's shards on the host, the process group getting
``cpu:gloo`` beside NCCL; FSDP2 with its optimizer on the host; the disk tier under a temporary
directory), the replicas' gradient reduction overlapped with the backward (its own CUDA stream and
events; two devices or more) and sequence parallelism (the all-to-all around attention; two devices or
more dividing the model's four heads). Each line gives the device peak
(``torch.cuda.max_memory_allocated``) beside the planner's prediction for that plan (``estimate_memory``,
rank 0). Last (not with ``--quick``): ``plan="auto", trials=3`` on every device, the planner's predicted
step beside the measured one for each plan it tried: how far this machine's calibration carries.

    python experiments/gpu_check.py                  # all visible GPUs
    python experiments/gpu_check.py --accelerator cpu --devices 1
    python experiments/gpu_check.py --quick --accelerator cpu --devices 1   # tiny: checks that it runs
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _harness as h
import lightning as L
import torch
from models import CharLM, StdlibText
from torch.utils.data import DataLoader

from lightning_parallel import PipelineStrategy, estimate_memory
from lightning_parallel.distributed.dtensors import full_tensors


class FixedOrderText(StdlibText):
    """The main job's data in a fixed order: DDP-based strategies re-seed the RNG at set-up
    (Lightning's reset_seed), so a shuffled order would differ from the plain one-device run."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)


HEADS = 4  # CharLM's: sequence parallelism needs a device count that divides them


def checks(devices: int, scratch: str) -> dict[str, PipelineStrategy]:
    """The strategies to check against one device, by name: those ``devices`` can run."""
    pp = {"pipeline_size": devices, "schedule": "1f1b"}
    out = {
        "1f1b +offload optimizer,activations": PipelineStrategy(**pp, offload=["optimizer", "activations"]),
        f"fsdp x{devices} +offload parameters": PipelineStrategy(
            pipeline_size=1, data_parallel="fsdp", offload="parameters"
        ),
        f"fsdp x{devices} +offload optimizer": PipelineStrategy(
            pipeline_size=1, data_parallel="fsdp", offload="optimizer"
        ),
        "1f1b +offload optimizer to disk": PipelineStrategy(
            **pp, offload="optimizer", offload_to="disk", offload_dir=scratch, offload_buffer="64MiB"
        ),
    }  # fmt: skip
    if devices > 1:
        out[f"replicas x{devices}, overlapped reduction"] = PipelineStrategy(pipeline_size=1)
    if devices > 1 and HEADS % devices == 0:
        out[f"sequence parallel x{devices}"] = PipelineStrategy(
            pipeline_size=1, sequence_parallel_size=devices
        )
    return out


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
    if isinstance(strategy, PipelineStrategy):
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if torch.cuda.is_available() else "n/a"
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
        planned = (
            f", planner's peak {planned_peak(strategy, devices, args)}" if trainer.global_rank == 0 else ""
        )
        print(f"rank {trainer.global_rank} {strategy.parallel_plan.label()} (backend {backend}): device peak "
              f"{peak}{planned}")  # fmt: skip
    state = full_tensors(model.state_dict())  # (FSDP2's shards gathered: every rank calls it)
    return {k: v.detach().float().cpu() for k, v in state.items()}, args.steps * args.batch_size / seconds


def planned_peak(strategy: PipelineStrategy, devices: int, args: argparse.Namespace) -> str:
    """The planner's prediction of the most bytes a rank holds under ``strategy``'s plan."""
    torch.manual_seed(0)
    model = CharLM(dim=args.dim, depth=args.depth, seq_len=64, lr=1e-3)
    x = torch.randint(0, 256, (args.batch_size, 64))
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # (CharLM's schedule
        # needs a Trainer: its optimizer, given)
        estimate = estimate_memory(model, (x, x), devices, strategy.parallel_plan, optimizer=optimizer)
    except Exception as err:  # (a plan the planner does not model: say so, the check goes on)
        return f"n/a ({type(err).__name__}: {str(err).splitlines()[0][:80]})"
    return f"{estimate.peak / 2**20:.1f} MiB"


def auto_with_trials(devices: int, args: argparse.Namespace) -> None:
    """``plan="auto", trials=3``: each tried plan's predicted and measured step, on this machine."""
    memory = "4GiB" if args.accelerator == "cpu" else None  # (a GPU reports its own)
    strategy = PipelineStrategy(
        plan="auto", memory=memory, global_batch_size=args.batch_size * devices, trials=3
    )
    L.seed_everything(0, verbose=False)
    model = CharLM(dim=args.dim, depth=args.depth, seq_len=64, lr=1e-3)
    trainer = h.quiet_trainer(accelerator=args.accelerator, devices=devices, strategy=strategy, max_steps=0)
    trainer.fit(model, FixedOrderText(seq_len=64, batch_size=args.batch_size, max_bytes=args.text_bytes))
    if strategy.planned is None:  # (rank 0 prints)
        return
    print(f"plan='auto', trials=3 on {args.accelerator} x{devices}: chose {strategy.parallel_plan.label()}")
    for t in strategy.planned.trials:
        measured = f"{t.measured * 1e3:.1f} ms" if t.measured is not None else "not run"
        print(f"  {t.plan.label():44} predicted {t.predicted * 1e3:8.1f} ms, measured {measured}")


def worst_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference from the one-device run over the whole model: each pipeline rank holds its
    stages' parameters only, so each compares what it holds and the ranks take the largest."""
    mine = max((params[k] - reference[k]).abs().max().item() for k in params if k in reference)
    if not torch.distributed.is_initialized():
        return mine
    every: list[float | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return max(v for v in every if v is not None)


def say(line: str) -> None:
    """Print on rank 0 only (every rank holds the same figure)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


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
        args.steps, args.batch_size, args.dim, args.depth, args.text_bytes = 2, 4, 32, args.devices, 20_000
    schedule = "1f1b"
    pipe = PipelineStrategy(pipeline_size=args.devices, schedule=schedule)
    pipelined, pipe_rate = train(pipe, args.devices, args)
    reference, ref_rate = train("auto", 1, args)
    worst = worst_difference(pipelined, reference)
    say(f"{args.accelerator} x{args.devices} {schedule}: max |param diff| vs one device = {worst:.2e}")
    say(f"samples/s: pipeline {pipe_rate:.1f}, one device without the strategy {ref_rate:.1f}")
    with tempfile.TemporaryDirectory(prefix="gpu_check_disk_") as scratch:
        for name, strategy in checks(args.devices, scratch).items():
            params, rate = train(strategy, args.devices, args)
            worst = worst_difference(params, reference)
            say(f"{args.accelerator} x{args.devices} {name}: max |param diff| vs one device = {worst:.2e}, "
                  f"samples/s {rate:.1f}")  # fmt: skip
    if not args.quick:
        auto_with_trials(args.devices, args)


if __name__ == "__main__":
    main()
