"""Smoke tests of the pipeline benchmarks: each script runs with its smallest settings, end to end.

They check the outputs' layout and values that must hold whatever the machine's speed (the two
loops of the overhead benchmark compute the same losses; a pipeline rank holds a fraction of DDP's
parameter bytes; other stages stay on the meta device), never timings.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out_dir: Path, *extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), "--quick", "--out-dir", str(out_dir), *extra],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.multiprocess
@pytest.mark.timeout(175)
def test_bench_pipeline_quick(tmp_path):
    stdout = _run("bench_pipeline.py", tmp_path, "--overhead-repeats", "1")
    overhead = _rows(tmp_path / "pipeline_overhead.csv")
    assert len(overhead) == 1
    row = overhead[0]
    assert {"hand_samples_per_s", "trainer_samples_per_s", "ratio", "fast_ratio", "max_loss_diff"} <= set(row)
    hand, trainer = float(row["hand_samples_per_s"]), float(row["trainer_samples_per_s"])
    assert hand > 0 and trainer > 0
    assert math.isclose(float(row["ratio"]), trainer / hand, rel_tol=1e-3)
    # Same weights, same batches, same schedule: the hand loop and the Trainer train identically.
    assert float(row["max_loss_diff"]) < 1e-4

    sweep = _rows(tmp_path / "pipeline_microbatches.csv")
    kinds = {(r["kind"], r["schedule"], int(r["num_microbatches"])) for r in sweep}
    for m in (1, 4, 16):
        assert {("pipeline", "gpipe", m), ("pipeline", "1f1b", m), ("single", "-", m)} <= kinds
    assert ("single_alone", "-", 1) in kinds
    for r in sweep:
        m = int(r["num_microbatches"])
        assert float(r["samples_per_s"]) > 0
        assert math.isclose(float(r["ideal_bubble_efficiency"]), m / (m + 1), rel_tol=1e-3)
        if r["kind"] == "pipeline":
            assert 0 < float(r["efficiency"]) < 10
    assert (tmp_path / "pipeline_microbatches.png").stat().st_size > 10_000
    assert "parallelism" in stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(175)
def test_bench_pipeline_memory_quick(tmp_path):
    _run("bench_pipeline_memory.py", tmp_path)
    rows = _rows(tmp_path / "pipeline_memory.csv")
    runs = {r["run"]: [x for x in rows if x["run"] == r["run"]] for r in rows}
    assert [(v[0]["strategy"], int(v[0]["world_size"])) for v in runs.values()] == [
        ("ddp", 2),
        ("pipeline", 2),
        ("pipeline", 4),
    ]
    for ranks in runs.values():
        assert len(ranks) == int(ranks[0]["world_size"])
        for r in ranks:
            param, grad, opt = (int(r[k]) for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            assert int(r["ppo_bytes"]) == param + grad + opt
            # float32 parameters: 4 bytes each; gradients the same; AdamW two moments (+ step counters).
            assert param == 4 * int(r["local_params"]) and grad == param
            assert 2 * param <= opt <= 2 * param + 4096
            # Activations were saved during the steps, and most released once training ended.
            assert int(r["activation_peak_bytes"]) > int(r["activation_live_after"]) >= 0
            assert int(r["local_params_meta"]) == 0
            if r["strategy"] == "pipeline":
                # The other stages' layers were never materialised on this rank.
                assert int(r["other_stage_params"]) > 0
                assert r["other_stage_params_meta"] == r["other_stage_params"]
                assert int(r["local_params"]) < int(r["model_params"])
            else:
                assert int(r["local_params"]) == int(r["model_params"])
                assert float(r["ppo_vs_ddp"]) == 1.0
        if ranks[0]["strategy"] == "pipeline":
            # The stages hold the whole model between them, each a part of DDP's bytes.
            assert sum(int(r["local_params"]) for r in ranks) == int(ranks[0]["model_params"])
            p = int(ranks[0]["world_size"])
            assert max(float(r["ppo_vs_ddp"]) for r in ranks) < 1.5 / p
    assert (tmp_path / "pipeline_memory.png").stat().st_size > 10_000
