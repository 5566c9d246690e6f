"""The suite's deadlock guard: a multi-process test stuck in a collective fails by timeout, fast."""

import os
import subprocess
import sys
import time
import uuid

import pytest
import torch.distributed as dist
from mp_harness import process_lines, processes_with_env, quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data


class _OneRankBlocks(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 0:
            dist.barrier()  # rank 1 never joins: a real deadlock, not a simulated one
        return super().training_step(batch, batch_idx)


@pytest.mark.hang_guard
@pytest.mark.timeout(8)
def test_deliberate_deadlock():
    # Forked ranks start at once (no imports), so they are deadlocked well before the 8 s run out.
    trainer = quiet_trainer(devices=2, strategy="ddp_fork", max_steps=2)
    trainer.fit(_OneRankBlocks(), loader(regression_data(), 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_deadlocked_test_fails_by_timeout_with_a_message():
    marker = f"LP_HANG_GUARD={uuid.uuid4().hex}"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "hang_guard", "-p", "no:cacheprovider", __file__],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=os.path.dirname(__file__),
        env={**os.environ, "LP_HANG_GUARD": marker.split("=")[1]},
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Timeout" in out and "1 failed" in out, out[-3000:]
    assert elapsed < 120, f"the hang took {elapsed:.0f} s to fail"
    # The guard also reclaims the stuck ranks: no process of that run is left behind.
    deadline = time.monotonic() + 10  # a killed process may take a moment to be reaped
    while (left := processes_with_env(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes of the deadlocked run still alive: {process_lines(left)}"
