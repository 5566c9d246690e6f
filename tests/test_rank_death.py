"""A rank that dies mid-step under pp 2 x dp 2 (FSDP2): every process ends with a report naming it, and
the last complete checkpoint resumes exactly.

The 4 ranks are started one by one, as SLURM or a multi-node torchrun does (no Lightning launcher to
notice the death), forked from the suite's forkserver; each saves a distributed checkpoint every step.
"""

import os
import time
from pathlib import Path

import pytest
import torch
from mp_harness import GatheredRecorder, assert_close_dicts, fit, free_port, quiet_trainer, run_ranks
from mp_harness import reference_loader as one_device_loader
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import HangWatchdog, PipelineStrategy, Rank0Checkpoint
from lightning_parallel.callbacks.watchdog import is_peer_failure

N_SAMPLES, GLOBAL_BATCH, STEPS = 64, 16, 8  # 4 steps an epoch
WORLD, TIMEOUT, DIES_AT = 4, 3.0, 4  # rank 3 dies inside the training step of global step 4 (epoch 1)


class Dying(SequentialRegressor):
    def __init__(self, dies: bool) -> None:
        super().__init__(hidden=32, depth=5, adam=True)
        self.dies = dies

    def training_step(self, batch, batch_idx):
        if self.dies and self.global_rank == 3 and self.global_step == DIES_AT:
            os.kill(os.getpid(), 9)  # what the OOM killer does, mid-step: its stage peers wait on it
        return super().training_step(batch, batch_idx)


def _rank(rank: int, port: int, out: str, dies: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.manual_seed(0)
    strategy = PipelineStrategy(
        pipeline_size=2, num_microbatches=2, data_parallel="fsdp", save_distributed_checkpoint=True
    )
    callbacks = [
        Rank0Checkpoint(
            dirpath=f"{out}/ckpt", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max"
        ),
        HangWatchdog(timeout=TIMEOUT, report_path=f"{out}/report.txt"),
        GatheredRecorder(f"{out}/resumed-rank{rank}.pt"),
    ]
    trainer = quiet_trainer(
        devices=WORLD, strategy=strategy, callbacks=callbacks, max_steps=STEPS, max_epochs=-1,
        enable_checkpointing=True,
    )  # fmt: skip
    data = regression_data(N_SAMPLES)
    trainer.fit(Dying(dies), loader(data, GLOBAL_BATCH // 2), ckpt_path=None if dies else "last")


def _run(out: Path, dies: bool) -> tuple[list[int], float]:
    port, start = free_port(), time.monotonic()
    codes = run_ranks(_rank, [(r, port, str(out), dies) for r in range(WORLD)], timeout=120)
    return codes, time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_rank_that_dies_mid_step_ends_the_job_with_a_report_and_the_last_checkpoint_resumes_exactly(
    tmp_path,
):
    codes, _ = _run(tmp_path, dies=True)
    report = (tmp_path / "report.txt").read_text()
    assert codes[3] == -9 and codes[:3] == [1, 1, 1], codes  # HangWatchdog's exit code on every survivor
    assert "diagnosis: rank 3 is gone" in report, report[:2000]
    # Every process ended within the watchdog's bound (timeout + 30 s) of the death (the last save).
    newest = max(p.stat().st_mtime for p in (tmp_path / "ckpt").rglob("*"))
    assert time.time() - newest < TIMEOUT + 30
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == [f"epoch=0-step={DIES_AT - 1}.ckpt", f"epoch=0-step={DIES_AT}.ckpt"], saved
    # Resumed from the newest complete directory (the step rank 3 died in saved nothing), the run ends
    # as one device's uninterrupted one.
    codes, _ = _run(tmp_path, dies=False)
    assert codes == [0] * WORLD, codes
    torch.manual_seed(0)
    ref = fit(
        Dying(False), one_device_loader(regression_data(N_SAMPLES), GLOBAL_BATCH), tmp_path / "ref",
        max_steps=STEPS, max_epochs=-1,
    )[0]  # fmt: skip
    resumed = [torch.load(tmp_path / f"resumed-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    params = {k: v for r in resumed for k, v in r["params"].items()}
    assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
    losses = torch.tensor([r["losses"] for r in resumed]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"])[-len(losses) :], rtol=1e-5, atol=1e-6)


def test_a_collective_that_failed_on_a_lost_peer_is_told_apart_from_other_errors():
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:12196")
    assert is_peer_failure(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise ValueError("the step failed") from err
    except ValueError as chained:
        assert is_peer_failure(chained)
    assert not is_peer_failure(ValueError("a bad batch"))
