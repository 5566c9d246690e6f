"""Smoke test of experiments/memory_validation.py: predictions against torch's MemTracker, end to end.

It also guards the two private torch 2.13 details the experiment leans on (MemTracker's module
tracker, PipelineStage's receive buffers; read in experiments/_meters.py): if they move, the measured
peaks drop or the run fails.
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from mp_harness import script_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_memory_validation_quick(tmp_path):
    env = script_env(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "memory_validation.py"), "--quick", "--out-dir",
         str(tmp_path)],
        capture_output=True, text=True, timeout=230, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with open(tmp_path / "memory_validation.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["config"] for r in rows] == ["ddp x2"] * 2 + ["pp 2x1 1f1b m=4 +ac"] * 2
    for r in rows:
        measured, predicted = int(r["measured_bytes"]), int(r["predicted_bytes"])
        # The tracked step starts from parameters + gradients + optimizer state, and grows beyond it.
        assert int(r["tracked_at_start"]) >= int(r["predicted_parameters"]) + int(
            r["measured_optimizer_state"]
        )
        assert measured > int(r["tracked_at_start"])
        assert abs(predicted / measured - 1) <= 0.15, r
    assert (tmp_path / "memory_validation.png").stat().st_size > 10_000
    assert "worst-rank errors beyond +/-15%: 0" in proc.stdout
