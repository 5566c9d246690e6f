"""The disk tier's faults on 2 gloo ranks (pipeline_size=1, 2 replicas, the state in files):

* a disk that fills during a step on one rank ends the job on every rank with that message (the disk,
  the offload_dir, the bytes), no hang; the checkpoint saved before it loads and is intact;
* a rank SIGKILLed during a step leaves a resumable job: resumed from the last checkpoint with the disk
  tier (the killed run's scratch emptied, never read), the run ends as the uninterrupted one.

The ranks are started one by one (as torchrun or SLURM does), forked from the suite's forkserver.
"""

import errno
import os
import time
from pathlib import Path

import pytest
import torch
from mp_harness import assert_close_dicts, free_port, quiet_trainer, run_ranks
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import HangWatchdog, PipelineStrategy, Rank0Checkpoint
from lightning_parallel.techniques.offload import scratch

WORLD, N_SAMPLES, BATCH, STEPS = 2, 32, 4, 6  # 4 steps an epoch per rank, 6 steps in all
FAILS_AT = 4  # the step (global_step) in which rank 1's disk fills, or rank 1 is killed
TIMEOUT = 3.0


class Faulty(SequentialRegressor):
    """Rank 1 meets its fault in the training step of ``FAILS_AT``: the disk fills (its next write of the
    optimizer state raises ENOSPC) or the process is killed."""

    def __init__(self, fault: str) -> None:
        super().__init__(hidden=16, depth=3, adam=True)
        self.fault = fault

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == FAILS_AT:
            if self.fault == "kill":
                os.kill(os.getpid(), 9)  # the OOM killer, mid-step
            if self.fault == "full":
                scratch.os.pwritev = _no_space
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        self.started_at = self.global_step


def _no_space(fd, buffers, offset):
    raise OSError(errno.ENOSPC, "No space left on device")


def _rank(rank: int, port: int, out: str, fault: str, resume: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.manual_seed(0)
    strategy = PipelineStrategy(pipeline_size=1, num_microbatches=2, offload="optimizer", offload_to="disk",
                                offload_dir=f"{out}/scratch", offload_buffer="256KiB")  # fmt: skip
    callbacks = [
        Rank0Checkpoint(
            dirpath=f"{out}/ckpt", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max"
        ),
        HangWatchdog(timeout=TIMEOUT, report_path=f"{out}/report-{rank}.txt"),
    ]
    trainer = quiet_trainer(devices=WORLD, strategy=strategy, callbacks=callbacks, max_steps=STEPS,
                            max_epochs=-1, enable_checkpointing=True)  # fmt: skip
    model = Faulty("none" if resume else fault)
    error = None
    try:
        trainer.fit(model, loader(regression_data(N_SAMPLES), BATCH), ckpt_path="last" if resume else None)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    record = {"error": error, "params": params, "step": trainer.global_step, "started": model.started_at}
    torch.save(record, f"{out}/{fault}-{rank}.pt")


def _run(out: Path, fault: str, resume: bool = False) -> list[int]:
    port = free_port()
    return run_ranks(_rank, [(r, port, str(out), fault, resume) for r in range(WORLD)], timeout=90)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_disk_full_on_one_rank_ends_every_rank_with_its_message_and_keeps_the_checkpoint(tmp_path):
    # The disk fills on rank 1 in step 4: both ranks end with the disk's message, the step-3 checkpoint
    # intact (it loads; the scratch was removed on both ranks).
    full = tmp_path / "full"
    (full / "scratch").mkdir(parents=True)
    start = time.monotonic()
    codes = _run(full, "full")
    assert time.monotonic() - start < 80 and codes == [0, 0], codes  # (every rank returned: no hang)
    for rank in range(WORLD):
        record = torch.load(full / f"full-{rank}.pt", weights_only=False)
        error = record["error"] or ""
        assert "DiskFullError" in error and "filled while the optimizer state was written" in error, error
        assert str(full / "scratch") in error and "bytes" in error, error
    assert not list((full / "scratch").iterdir()), "the scratch is removed on every rank"
    saved = sorted((full / "ckpt").iterdir())
    assert [p.name for p in saved] == [f"epoch=0-step={FAILS_AT}.ckpt"], saved  # (the step before the fault)
    checkpoint = torch.load(saved[0], weights_only=False)
    state = checkpoint["optimizer_states"][0]["state"]
    assert checkpoint["global_step"] == FAILS_AT and len(state) == 6
    assert all(torch.isfinite(s["exp_avg_sq"]).all() and (s["exp_avg_sq"] > 0).any() for s in state.values())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_step_leaves_a_job_that_resumes_with_the_disk_tier_as_the_uninterrupted_one(
    tmp_path,
):
    run = tmp_path / "killed"
    (run / "scratch").mkdir(parents=True)
    codes = _run(run, "kill")
    assert codes[1] == -9 and codes[0] != 0, codes  # (rank 0 ended too: its peer gone)
    saved = sorted(p.name for p in (run / "ckpt").iterdir())
    assert saved == [f"epoch=0-step={FAILS_AT}.ckpt"], saved
    # What the killed rank left in its scratch (its lock; a named file where the filesystem has no unnamed
    # ones): never read by the resumed run, which takes the state from the checkpoint and empties it.
    stale = run / "scratch" / "rank1" / "optimizer-stale.state"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"\xff" * 4096)  # (NaNs, were it read as the state)
    assert _run(run, "kill", resume=True) == [0, 0]
    reference = tmp_path / "uninterrupted"
    (reference / "scratch").mkdir(parents=True)
    assert _run(reference, "none") == [0, 0]
    for rank in range(WORLD):
        resumed = torch.load(run / f"kill-{rank}.pt", weights_only=False)
        whole = torch.load(reference / f"none-{rank}.pt", weights_only=False)
        assert resumed["error"] is None and whole["error"] is None, (resumed["error"], whole["error"])
        assert resumed["step"] == whole["step"] == STEPS
        assert (resumed["started"], whole["started"]) == (FAILS_AT, 0)  # (resumed from the checkpoint)
        assert_close_dicts(resumed["params"], whole["params"], rtol=1e-5, atol=1e-5)
    assert not list((run / "scratch").iterdir()), "the scratch is removed, the stale file with it"
