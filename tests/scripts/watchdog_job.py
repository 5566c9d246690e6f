"""A user's script with HangWatchdog and ``strategy="ddp"`` on 2 processes.

python watchdog_job.py --scenario barrier --timeout 3 --report hang.txt   # rank 1 alone calls barrier
LOCAL_RANK=R MASTER_ADDR=... MASTER_PORT=... python watchdog_job.py --scenario kill --timeout 3
    # each rank started by an outside launcher (as under SLURM); rank 1 is SIGKILLed mid-run
"""

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L
import torch
import torch.distributed as dist
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import HangWatchdog


def hang_starts() -> None:
    """For the tests: the time the hang begins, as the mtime of a file they name."""
    if "LP_WATCHDOG_HANG_MARK" in os.environ:
        open(os.environ["LP_WATCHDOG_HANG_MARK"], "a").close()


class Job(SequentialRegressor):
    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario = scenario

    def training_step(self, batch, batch_idx):
        if self.scenario == "barrier" and batch_idx == 3 and self.global_rank == 1:
            hang_starts()
            dist.barrier()  # only rank 1 gets here: a collective inside a rank-dependent branch
        if self.scenario == "kill" and batch_idx == 2:
            hang_starts()
            if self.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
            time.sleep(600)  # rank 0 computes on and never notices by itself
        return super().training_step(batch, batch_idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=["barrier", "kill"], required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--report", default=None, help="also write the hang report to this file")
    args = p.parse_args()
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[HangWatchdog(timeout=args.timeout, report_path=args.report)],
    )  # fmt: skip
    trainer.fit(Job(args.scenario), loader(regression_data(), 8))


if __name__ == "__main__":
    main()
