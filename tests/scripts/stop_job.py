"""A user's 2-rank PipelineStrategy job that trains until it is told to stop, for tests/test_stop.py.

python stop_job.py --out DIR --start-method spawn|fork|forkserver|popen [--block] [--grace 4] [--slow first]
torchrun --nproc-per-node 2 stop_job.py --out DIR ...          # torchrun starts both ranks
SLURM_PROCID=R ... python stop_job.py --out DIR ...             # each rank started as under SLURM

Each rank writes ``ready-rank{R}`` (its pid) once training runs, then waits (asleep) until the test
writes ``go``: the jobs that started first do not train, taking the cores, while the others import.
After ``go`` each rank writes ``training-rank{R}`` at the next batch; with ``--block`` rank 1 instead
calls a barrier (after the ready batch) that rank 0 never calls, so both ranks sit in a communication
when the signal comes. A ``Rank0Checkpoint(save_on_exception=True)`` saves when Lightning stops the fit
on SIGTERM (or, on SIGINT, runs its KeyboardInterrupt path). The slow rank is the last stage's (its loss
takes 50 ms), or with ``--slow first`` the first stage's (its forward does): whichever rank a stop
signal finds outside a communication, the other one is waiting on it.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L
import torch
import torch.distributed as dist
from tiny_models import SequentialRegressor, loader, regression_data
from torch import nn

from lightning_parallel import PipelineStrategy, Rank0Checkpoint


class Slow(nn.Module):
    """A forward that takes 50 ms (no parameters: the stages split as without it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x


class Job(SequentialRegressor):
    def __init__(self, out: str, block: bool, slow: str) -> None:
        super().__init__()
        self.out, self.block, self.slow = out, block, slow
        if slow == "first":  # in the first block: the first stage's forward of each micro-batch
            self.layers[0].append(Slow())

    def training_step(self, batch, batch_idx):
        if self.global_step == 3 and batch_idx == 3:
            self._mark(f"training-rank{self.global_rank}")
        # A step that takes a while: the job is training when the signal comes. (Not much longer: after
        # SIGTERM the ranks agree to stop two batches later, then save, within the 4 s grace period.)
        # The last stage computes the loss: this step's sleep is that stage's.
        if self.slow == "last":
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)

    def _mark(self, name: str) -> None:
        """Write ``name`` (this process's pid) at once: the test reads it whole or not at all."""
        path = os.path.join(self.out, name)
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 3 and batch_idx == 2:
            self._mark(f"ready-rank{self.global_rank}")
            # After the batch's every communication (in a step, one stage's rank waits for another's):
            # neither rank waits on the other here.
            while not os.path.exists(os.path.join(self.out, "go")):
                time.sleep(0.1)
        # Outside the step (where a collective over other stages' ranks is refused): rank 0 never
        # calls it and goes on to the next batch's pipeline receive, so both ranks wait from now on.
        if self.block and self.global_step == 3 and self.global_rank == 1:
            self._mark("blocked-rank1")  # (the test signals after this)
            dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--start-method", default="popen")
    p.add_argument("--grace", type=float, default=4.0)
    p.add_argument("--block", action="store_true")
    p.add_argument("--slow", choices=["first", "last"], default="last")
    args = p.parse_args()
    torch.manual_seed(0)
    strategy = PipelineStrategy(
        pipeline_size=2, num_microbatches=2, start_method=args.start_method, stop_grace_period=args.grace
    )
    ckpt = Rank0Checkpoint(dirpath=os.path.join(args.out, "ckpt"), save_on_exception=True, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1000, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
    )  # fmt: skip
    trainer.fit(Job(args.out, args.block, args.slow), loader(regression_data(64), 8))


if __name__ == "__main__":
    main()
