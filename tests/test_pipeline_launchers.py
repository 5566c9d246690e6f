"""PipelineStrategy under the launchers users run it with: torchrun on two "nodes", a plain script.

Covers strategies/pipeline/release.py: a script's ranks end with status 0, their process groups released
before the interpreter's finalisation.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mp_harness import (
    assert_close_dicts,
    fit,
    free_port,
    load_rank_results,
    process_lines,
    processes_with_env,
    reference_loader,
)
from tiny_models import SequentialRegressor, regression_data

JOB = Path(__file__).parent / "scripts" / "pipeline_job.py"


def _torchrun_node(rank: int, port: int, out: Path) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    launcher += ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    job = [str(JOB), "--out", str(out), "--num-nodes", "2", "--devices", "1"]
    return subprocess.Popen(
        launcher + job, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_torchrun_nodes_on_localhost_match_one_device(tmp_path):
    torch.manual_seed(0)
    ref = fit(SequentialRegressor(), reference_loader(regression_data(), 16), tmp_path / "ref", devices=1)[0]
    port = free_port()
    nodes = [_torchrun_node(rank, port, tmp_path / "pp") for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    records = load_rank_results(tmp_path / "pp")
    assert [r["world_size"] for r in records] == [2, 2]
    assert_close_dicts({**records[0]["params"], **records[1]["params"]}, ref["params"])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_predict_returns_every_prediction_on_rank_zero_under_the_script_launcher(tmp_path):
    command = [sys.executable, str(JOB), "--out", str(tmp_path), "--devices", "2", "--mode", "predict"]
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = torch.load(tmp_path / "pred.pt", weights_only=False)
    torch.manual_seed(0)
    model = SequentialRegressor()
    with torch.no_grad():
        expected = model(regression_data(23, seed=1).tensors[0])
    torch.testing.assert_close(torch.cat(saved["predictions"]), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_ends_a_script_job_with_its_message(tmp_path, fail_rank):
    """Rank 0 started rank 1 itself (script launcher): either one failing ends both, with its error."""
    marker = f"LP_JOB={tmp_path.name}-{fail_rank}"
    env = {**_env(), "LP_JOB": marker.split("=")[1]}
    command = [
        sys.executable,
        str(JOB),
        "--out",
        str(tmp_path),
        "--devices",
        "2",
        "--fail-rank",
        str(fail_rank),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert f"boom on rank {fail_rank}" in proc.stdout + proc.stderr
    deadline = time.monotonic() + 20
    while (left := processes_with_env(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"ranks of the failed job still alive: {process_lines(left)}"
