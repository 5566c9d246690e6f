"""notebooks/quickstart.ipynb runs top to bottom in a Jupyter kernel and produces what it promises."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from lightning_parallel.io import atomic

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _this_interpreters_kernel(tmp_path: Path) -> KernelManager:
    """A "python3" kernel that runs this interpreter, whatever python3 kernelspecs the user has installed.

    Jupyter looks up kernelspecs in the user's data directory before the virtual environment's, so a
    user-level "python3" spec could run another Python that lacks lightning_parallel.
    """
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return KernelManager(kernel_name="python3", kernel_spec_manager=specs)


def _stream_text(nb: nbformat.NotebookNode) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.output_type == "stream"
    )


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    dirty = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count is not None]
    assert not dirty, f"code cells {dirty} carry outputs: clear them before committing"
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_quickstart_runs_top_to_bottom(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("QUICKSTART_RUN_DIR", str(run_dir))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb,
        km=_this_interpreters_kernel(tmp_path),
        timeout=200,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failing cell

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["python"] == sys.executable

    # The stage table: printed by rank 0 (forked from the kernel) and kept on disk by the notebook.
    printed = _stream_text(nb)
    assert "PipelineStrategy stage plan" in printed
    table = Path(summary["stage_table"]).read_text()
    assert "2 stages on 2 pipeline ranks x 1 data-parallel replicas" in table
    assert table in printed

    with open(summary["csv_log"], newline="") as f:
        rows = list(csv.DictReader(f))
    train_loss = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val_loss = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(train_loss) >= 10 and len(val_loss) == 5
    assert train_loss[-1] < train_loss[0]
    assert Path(summary["loss_plot"]).stat().st_size > 0

    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.parent == run_dir / "checkpoints"
    assert atomic.verify_checkpoint(str(checkpoint)).ok  # Rank0Checkpoint's hash is in the file
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    # Consolidated: both stages' layers under their unsplit names (stage 0 holds 0-2, stage 1 holds 3-4).
    assert {k.split(".")[1] for k in state} == {"0", "1", "2", "3", "4"}
    assert summary["last_ckpt_matches_model"] is True
    assert summary["optimizer_steps"] == 5 * 2048 // 64

    assert summary["prediction_shape"] == [512]
    assert summary["val_accuracy"] > 0.9
