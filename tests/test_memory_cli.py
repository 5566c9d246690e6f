"""``python -m lightning_parallel.memory``: the table, the fastest fit, and clear errors."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_parallel.memory.__main__ import main, parse_bytes

ROOT = Path(__file__).resolve().parents[1]

MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class TinyLM(nn.Module):
        def __init__(self, dim=16, depth=4):
            super().__init__()
            wide = lambda: nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            blocks = [wide() for _ in range(depth)]
            self.layers = nn.Sequential(nn.Embedding(64, dim), *blocks, nn.Linear(dim, 64))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.layers(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())
    """
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny_lm.py"
    path.write_text(MODEL)
    return f"{path}:TinyLM"


def test_table_marks_the_fits_and_names_the_fastest(model_file, capsys):
    code = main([model_file, "--init", "dim=32", "--batch", "long:16", "long:16", "--global-batch-size", "16",
                 "--devices", "2", "--memory", "600KiB"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "TinyLM: " in out and "6 pipeline units (sequential `layers`)" in out
    assert "ddp x2" in out and "pp 2x1 1f1b m=2" in out and "pp 1x2 1f1b m=4 +ac +zero" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("ddp", "pp "))]
    fits = [ln for ln in rows if "  yes  " in ln]
    assert fits and len(fits) < len(rows)  # the budget splits the candidates
    assert sum("<- fastest that fits" in ln for ln in rows) == 1
    best = next(ln for ln in rows if "<- fastest that fits" in ln)
    assert best in fits and rows.index(best) == min(rows.index(ln) for ln in fits)  # ranked fastest first
    assert "fastest that fits 600.00 KiB:" in out and "peak" in out


def test_nothing_fits(model_file, capsys):
    code = main([model_file, "--batch", "long:16", "long:16", "--devices", "2", "--memory", "1KiB"])
    assert code == 1
    assert "nothing fits 1.00 KiB: the smallest peak is" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--batch", "long:16"], r"TinyLM rejected the batch .*training_step"),
        (["--batch", "long:16", "long:16", "--pipeline-sizes", "8"], "pipeline size 8 does not fit: it must"),
        (["--batch", "cplx:16"], "unknown dtype 'cplx'"),
        (["--batch", "long:16", "long:16", "--memory", "lots"], "cannot read the memory size 'lots'"),
        (["--batch", "long:16", "long:16", "--optimizer", "Adamm"], "torch.optim has no optimizer 'Adamm'"),
    ],
)
def test_bad_input_gets_a_clear_error(model_file, capsys, extra, match):
    argv = [model_file, "--devices", "2", "--memory", "1GiB", *extra]
    if "--memory" in extra:
        argv = [model_file, "--devices", "2", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert re.search(match, err), err


def test_a_model_without_units_and_a_missing_model(capsys):
    assert main(["torch.nn:Linear", "--init", "in_features=4", "out_features=2", "--batch", "float32:4",
                 "--devices", "1", "--memory", "1GiB", "--optimizer", "SGD"]) == 2  # fmt: skip
    assert "Linear has no pipeline units" in capsys.readouterr().err
    assert main(["no_such.module:Model", "--batch", "long:4", "--devices", "1", "--memory", "1GiB"]) == 2
    assert "cannot import 'no_such.module'" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512") == 512


def test_the_module_runs_as_a_command(model_file):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_parallel.memory", model_file, "--batch", "long:16", "long:16",
         "--devices", "4", "--memory", "24GiB", "--precision", "bf16-mixed"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fastest that fits 24.00 GiB: ddp x4" in proc.stdout
    assert "pp 4x1 interleaved_1f1b v=2 m=8" not in proc.stdout  # 4 blocks: no room for 8 stages
    assert "pp 2x2 interleaved_1f1b v=2 m=4" in proc.stdout


def test_a_hugging_face_config_is_planned_from_its_config_json(tmp_path, capsys):
    import hf_env

    transformers = hf_env.require("transformers")
    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    transformers.LlamaConfig(**size, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    code = main(["lightning_parallel.memory.hf:causal_lm", "--init", f"config={tmp_path}", "--meta",
                 "--batch", "long:16", "long:16", "--global-batch-size", "8", "--devices", "2",
                 "--memory", "1GiB", "--optimizer", "AdamW"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 pipeline units (blocks `model.model.layers`)" in out and "pp 2x1 1f1b m=8" in out
    assert "tp=" not in out
    # Tensor-parallel shapes too, each measured on one tp rank's local model (its split weights halved).
    code = main(["lightning_parallel.memory.hf:causal_lm", "--init", f"config={tmp_path}", "--meta",
                 "--batch", "long:16", "long:16", "--global-batch-size", "8", "--devices", "4",
                 "--memory", "1GiB", "--optimizer", "AdamW",
                 "--tensor-parallel-sizes", "1", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {ln.split("  ")[0]: ln for ln in out.splitlines() if ln.startswith(("ddp", "pp "))}
    assert "pp 2x1 1f1b m=4 tp=2" in rows and "pp 1x2 1f1b m=4 +zero tp=2" not in rows, sorted(rows)
    assert "pp 2x1 1f1b m=4 +zero tp=2" not in rows  # ZeRO-1 does not take split weights
    with pytest.raises(SystemExit):
        main(["lightning_parallel.memory.hf:causal_lm", "--devices", "4", "--memory", "1GiB",
              "--tensor-parallel-sizes", "two"])  # fmt: skip


def _planner_page() -> tuple[list[str], str, re.Match[str]]:
    """docs/planner.md's command (as argv), the table it quotes, and its sentence on a smaller budget."""
    section = (ROOT / "docs" / "planner.md").read_text().split("# Will it fit?", 1)[1]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    argv = command.split()
    assert argv[:3] == ["python", "-m", "lightning_parallel.memory"], command
    table = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    answer = re.search(r"With `--memory (\S+)` the same command answers `([^`]+)` \(([\d.]+ \w+)\)", section)
    assert answer, "docs/planner.md's sentence on a smaller budget has changed form: update this test with it"
    return argv[3:], table, answer


def test_the_planner_page_quotes_what_the_planner_prints(capsys, monkeypatch):
    # docs/planner.md's table and its "With --memory X the same command answers Y (Z)" are the command's
    # own output; regenerate them with that command when the planner or CharLM changes.
    argv, table, answer = _planner_page()
    monkeypatch.chdir(ROOT)
    assert main(argv) == 0
    assert capsys.readouterr().out == table
    budget, config, peak = answer.groups()
    memory = argv.index("--memory")
    assert main([*argv[:memory], "--memory", budget, *argv[memory + 2 :]]) == 0
    out = capsys.readouterr().out
    assert f": {config} (est. time" in out, out[-800:]
    row = rf"^{re.escape(config)} +\d+ +\d+ +{re.escape(peak)} +yes "  # its peak, and it fits
    assert re.search(row, out, re.M), out
