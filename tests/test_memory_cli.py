"""``python -m lightning_parallel.planner``: the table, the chosen plan as code, nothing fits, clear errors.

Covers planner/quantities.py (sizes, rates and durations as written) and, through the command's default
links, distributed/link_timing.py's loopback timing, and memory/__main__.py (the command's former name,
kept) (its group timing: tests/test_autoplan.py's job).
"""

import re
import runpy
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_parallel import PipelineStrategy
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.__main__ import links_of, main, parse_args, parse_bytes, search_of
from lightning_parallel.planner.ranking import Budget
from lightning_parallel.planner.search import SEARCHED_SCHEDULES, Search

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


    class FlatLM(nn.Module):  # no Sequential, no ModuleList: nothing to split, run whole
        def __init__(self, dim=16):
            super().__init__()
            self.embed, self.mix, self.head = nn.Embedding(64, dim), nn.Linear(dim, dim), nn.Linear(dim, 64)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(torch.tanh(self.mix(self.embed(x)))).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())
    """
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny_lm.py"
    path.write_text(MODEL)
    return f"{path}:TinyLM"


GIVEN_LINKS = ["--bandwidth", "10GB/s", "--latency", "10us"]  # (not timed on loopback: faster, steadier)


def test_table_marks_the_fits_and_prints_the_chosen_plan_as_code(model_file, capsys):
    code = main([model_file, "--init", "dim=32", "--batch", "long:16", "long:16", "--global-batch-size", "16",
                 "--devices", "2", "--memory", "600KiB", "--rows", "0", *GIVEN_LINKS])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "TinyLM: " in out and "6 pipeline units (sequential `layers`)" in out
    assert "budget 600.00 KiB per device, host" in out and "(margin 10%)" in out
    assert "units timed here (cpu) at micro-batches of 2 and 8; links given: send 10 us + 10.00 GB/s" in out
    assert "pp 1x2 1f1b m=1" in out and "pp 2x1 1f1b m=2" in out and "pp 1x2 1f1b m=4 +ac +zero" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("pp ") and " ms " in ln]
    fits = [ln for ln in rows if "  yes  " in ln]
    assert fits and len(fits) < len(rows)  # the budget (less its 10% margin) splits the candidates
    steps = [float(ln.split(" ms")[0].split()[-1]) for ln in rows]
    assert steps == sorted(steps)  # fastest first (one global batch: per step is per sample)
    best = next(ln for ln in rows if "<- chosen" in ln)
    assert sum("<- chosen" in ln for ln in rows) == 1 and best in fits
    assert rows.index(best) == min(rows.index(ln) for ln in fits)
    reasons = r"device peak .*bubble .*imbalance .*communication .*recomputation .*offload"
    chosen = re.search(rf"^chosen: (.+?) \((\S+) ms per step; {reasons}", out, re.M)
    assert chosen and best.startswith(chosen.group(1) + " "), out[-2000:]
    line = re.search(r"^    (PipelineStrategy\(.*\))$", out, re.M).group(1)
    strategy = eval(line, {"PipelineStrategy": PipelineStrategy})
    assert strategy.parallel_plan.for_devices(2, "32-true").label() == chosen.group(1)
    assert out.count("  then: ") == 3 and "x the time; device peak" in out


def test_nothing_fits_says_by_how_much_and_what_would(model_file, capsys):
    code = main(
        [model_file, "--batch", "long:16", "long:16", "--devices", "2", "--memory", "1KiB", *GIVEN_LINKS]
    )
    out = capsys.readouterr().out
    assert code == 1
    found = re.search(r"no plan fits 1.00 KiB per device, host .*: the smallest device peak is ([\d.]+ KiB) "
                      r"\((pp [^)]+)\), [\d.]+ KiB \(\d+%\) over the 921 B usable", out)  # fmt: skip
    assert found, out[-2000:]
    assert re.search(r"  - 4 devices: smallest peak [\d.]+ KiB \(pp \S+ .*\): still over", out)
    assert re.search(r"  - a batch of 8 per replica \(accumulating twice as many\): smallest peak", out)
    assert "recomputation, sharded optimizer state and offload are in the search already" in out


def test_the_arguments_mean_what_plan_auto_takes():
    args = parse_args(["m:M", "--devices", "8", "--nodes", "2", "--memory", "24GiB", "--host-memory", "64GiB",
                       "--global-batch-size", "64", "--batch-size", "4", "--margin", "0.2",
                       "--no-offload"])  # fmt: skip
    search, budget = search_of(args)
    assert search == Search(
        8, 64, 4, "32-true", None, SEARCHED_SCHEDULES, (1,), ranks_per_node=4, offload=False
    )
    assert budget == Budget(24 * 2**30, 64 * 2**30, ranks_per_node=4, margin=0.2)
    assert search.batches(ParallelPlan("pipeline", 8, 2)) == (4, 4)  # 4 replicas x 4 samples x 4 batches
    assert search.batches(ParallelPlan("pipeline", 8, 8)) == (4, 16)
    assert search.batches(ParallelPlan("pipeline", 8, 1)) == (4, 2)
    assert Search(8, 64).batches(ParallelPlan("pipeline", 8, 2)) == (
        16,
        1,
    )  # no loader yet: global / replicas
    with pytest.raises(ValueError, match=r"--nodes \(3\) must divide --devices \(8\)"):
        search_of(parse_args(["m:M", "--devices", "8", "--nodes", "3", "--memory", "1GiB"]))
    for given, asked in (
        ([], None),
        (["--sequence-parallel", "yes"], True),
        (["--sequence-parallel", "no"], False),
    ):
        assert (
            search_of(parse_args(["m:M", "--devices", "2", "--memory", "1GiB", *given]))[0].sequence_parallel
            is asked
        )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--batch", "long:16"], r"TinyLM rejected the batch .*training_step"),
        (["--batch", "long:16", "long:16", "--pipeline-sizes", "8"], "pipeline size 8 does not fit: it must"),
        (["--batch", "cplx:16"], "unknown dtype 'cplx'"),
        (["--batch", "long:16", "long:16", "--memory", "lots"], "cannot read the memory size 'lots'"),
        (["--batch", "long:16", "long:16", "--optimizer", "Adamm"], "torch.optim has no optimizer 'Adamm'"),
        # (a traceback from the empty table before: one line naming what cannot be split, and the fix)
        (
            ["--batch", "long:16", "long:16", "--global-batch-size", "7"],
            r"^error: no plan splits the global batch \(7\) over 2 devices \(pp 1x2: 7 is not a multiple "
            r"of its 2 replicas; pp 2x1: 7 per replica cannot make 2, 4 or 8 equal micro-batches\): use a "
            r"global batch of e\.g\. 6 or 8$",
        ),
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


def test_a_model_with_nothing_to_split_gets_the_plans_that_need_no_split(model_file, capsys):
    flat = model_file.replace(":TinyLM", ":FlatLM")
    code = main([flat, "--batch", "long:16", "long:16", "--global-batch-size", "16", "--devices", "2",
                 "--memory", "1GiB", "--rows", "0", *GIVEN_LINKS])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FlatLM: 2,384 parameters, no pipeline units (no top-level nn.Sequential holding every " in out
    rows = [ln for ln in out.splitlines() if ln.startswith("pp ")]
    assert rows and all(ln.startswith("pp 1x2 1f1b ") for ln in rows), rows  # replicas, ZeRO-1, offload
    assert any("+zero" in ln for ln in rows) and any("+ac" in ln for ln in rows)
    line = re.search(r"^    (PipelineStrategy\(.*\))$", out, re.M).group(1)
    assert eval(line, {"PipelineStrategy": PipelineStrategy}).parallel_plan.pipeline_size == 1


def test_a_model_on_the_meta_device_gets_the_most_frugal_plan_and_is_told_so(model_file, capsys):
    code = main([model_file, "--meta", "--batch", "long:16", "long:16", "--global-batch-size", "16",
                 "--devices", "2", "--memory", "1GiB", "--rows", "0", *GIVEN_LINKS])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    # Untimed (no time estimate without running the units), so said on the timing line and on the choice.
    assert "not timed (a model on the meta device): plans ranked by their device peak, so the chosen one " \
           "is the most frugal that fits, not the fastest" in out  # fmt: skip
    chosen = re.search(r"^chosen: (.+?) \(not timed: the most frugal plan that fits \(the smallest device "
                       r"peak\), not the fastest; device peak ([\d.]+ [KMG]?i?B)", out, re.M)  # fmt: skip
    assert chosen, out[-2000:]
    fits = [re.split(r"\s{2,}", ln) for ln in out.splitlines() if ln.startswith("pp ") and "  yes  " in ln]
    assert fits[0][0] == chosen.group(1) and fits[0][-1] == "<- chosen"
    assert parse_bytes(chosen.group(2)) == min(parse_bytes(row[3]) for row in fits)


def test_offload_dir_offers_the_disk_tier_chosen_only_where_the_host_cannot_hold_the_state(
    model_file, capsys, tmp_path
):
    """``--offload-dir``: every optimizer offload also on the disk (a ``disk/node`` column); a loose
    ``--host-memory`` keeps the state on the host (the disk rows "not needed"), a tight one chooses the
    disk; ``--disk-memory`` is the disk's budget, ``--disk-bandwidth`` its rate (the default: measured in
    the directory)."""
    wide = [model_file, "--meta", "--init", "dim=4096", "--batch", "long:16", "long:16",
            "--global-batch-size", "16", "--devices", "2", "--memory", "6GiB", "--rows", "0",
            "--offload-dir", "/nvme", "--disk-bandwidth", "2GB/s", *GIVEN_LINKS]  # fmt: skip

    def planned(*extra: str) -> tuple[str, list[list[str]]]:
        code = main([*wide, *extra])
        out = capsys.readouterr().out
        assert code == 0, out
        lines = out.splitlines()
        header = re.split(r"\s{2,}", next(ln for ln in lines if ln.startswith("configuration")))
        assert header[3:7] == ["device peak", "host/node", "disk/node", "fits"]
        return out, [re.split(r"\s{2,}", ln) for ln in lines if ln.startswith("pp ") and "  " in ln]

    out, rows = planned("--host-memory", "256GiB")
    disk = [r for r in rows if "+offload opt on disk" in r[0]]
    assert disk and all(r[6] in ("not needed", "no") for r in disk) and "not needed" in {r[6] for r in disk}
    for row in disk:  # (two ranks on the node, a 1 GiB buffer each; their state in files)
        assert row[4] == "2.00 GiB" and parse_bytes(row[5]) > 0, row
    assert all(row[5] == "0 B" for row in rows if "on disk" not in row[0])
    assert "offload_to='disk'" not in out
    out, rows = planned("--host-memory", "6GiB")
    assert "PipelineStrategy(pipeline_size=2, num_microbatches=8, activation_checkpointing=True, " \
           "offload=['optimizer'], offload_to='disk', offload_dir='/nvme')" in out  # fmt: skip
    assert "per node of 2 (margin 10%)" in out.splitlines()[0]  # (/nvme is not here: its room unchecked)
    lines = out.splitlines()
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("rank ")) :]
    assert table[0].split()[-3:] == ["(device)", "host", "disk"]
    assert table[-1].startswith("offload_to='disk': the files are read and written once per optimizer step")
    out, rows = planned("--host-memory", "6GiB", "--disk-memory", "1GiB")
    assert "budget 6.00 GiB per device, host 6.00 GiB per node of 2, disk 1.00 GiB per node" in out
    assert all(r[6] == "no" for r in rows if "on disk" in r[0]) and "offload_to='disk'" not in out
    args = parse_args([model_file, "--devices", "2", "--memory", "1GiB", "--offload-dir", str(tmp_path)])
    assert search_of(args)[1].disk == shutil.disk_usage(tmp_path).free  # (default: its free space)
    assert links_of(replace_args(args, bandwidth="1GB/s")).disk.bandwidth > 1e6  # (measured there)
    assert links_of(replace_args(args, bandwidth="1GB/s", disk_bandwidth="3GB/s")).disk.bandwidth == 3e9


def replace_args(args, **changes):
    return type(args)(**{**vars(args), **changes})


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512") == 512


def test_the_module_runs_as_a_command(model_file, capsys, monkeypatch):
    # As `python -m lightning_parallel.planner ...` runs it (runpy runs the package's __main__ as "__main__"),
    # in this process: a new interpreter would add half a minute of imports on 2 cores.
    argv = [model_file, "--batch", "long:16", "long:16", "--devices", "4", "--memory", "24GiB",
            "--precision", "bf16-mixed", "--rows", "0"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["python -m lightning_parallel.planner", *argv])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("lightning_parallel.planner", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exited.value.code == 0, out[-3000:]
    assert "links measured on this machine's loopback: send" in out
    assert re.search(r"^chosen: pp \S+ .* ms per step", out, re.M)
    assert "pp 4x1 interleaved_1f1b v=2 m=8" not in out  # 4 blocks: no room for 8 stages
    assert "pp 2x2 interleaved_1f1b v=2 m=4" in out


def test_the_former_name_of_the_command_still_runs_it(capsys, monkeypatch):
    # `python -m lightning_parallel.memory`, as earlier releases' docs wrote it.
    monkeypatch.setattr(sys, "argv", ["python -m lightning_parallel.memory", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("lightning_parallel.memory", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0
    assert "usage: python -m lightning_parallel.planner" in capsys.readouterr().out  # (its name now)


def test_a_hugging_face_config_is_planned_from_its_config_json(tmp_path, capsys):
    import hf_env

    transformers = hf_env.require("transformers")
    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    transformers.LlamaConfig(**size, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    code = main(["lightning_parallel.planner.hf:causal_lm", "--init", f"config={tmp_path}", "--meta",
                 "--batch", "long:16", "long:16", "--global-batch-size", "8", "--devices", "2",
                 "--memory", "1GiB", "--optimizer", "AdamW", "--rows", "0", "--no-offload",
                 *GIVEN_LINKS])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 pipeline units (blocks `model.model.layers`)" in out and "pp 2x1 1f1b m=8" in out
    assert "not timed (a model on the meta device): plans ranked by their device peak" in out
    assert "tp=" not in out
    # Tensor-parallel shapes too, each measured on one tp rank's local model (its split weights halved).
    code = main(["lightning_parallel.planner.hf:causal_lm", "--init", f"config={tmp_path}", "--meta",
                 "--batch", "long:16", "long:16", "--global-batch-size", "8", "--devices", "4",
                 "--memory", "1GiB", "--optimizer", "AdamW", "--rows", "0", "--no-offload", *GIVEN_LINKS,
                 "--tensor-parallel-sizes", "1", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {ln.split("  ")[0]: ln for ln in out.splitlines() if ln.startswith(("ddp", "pp "))}
    assert "pp 2x1 1f1b m=4 tp=2" in rows and "pp 2x2 1f1b m=4 +zero" in rows, sorted(rows)
    assert "pp 1x2 1f1b m=4 tp=2 +zero" not in rows  # ZeRO-1 does not take split weights
    assert "pp 1x2 1f1b m=4 tp=2" in rows
    with pytest.raises(SystemExit):
        main(["lightning_parallel.planner.hf:causal_lm", "--devices", "4", "--memory", "1GiB",
              "--tensor-parallel-sizes", "two"])  # fmt: skip


def _planner_page() -> tuple[list[str], str, re.Match[str]]:
    """docs/planner.md's command (as argv), the table it quotes, and its sentence on a smaller budget."""
    section = (ROOT / "docs" / "planner.md").read_text().split("# Will it fit?", 1)[1]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    argv = command.split()
    assert argv[:3] == ["python", "-m", "lightning_parallel.planner"], command
    table = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    sentence = r"With `--memory (\S+)` the plans that fit shrink to those like `([^`]+)` \(([\d.]+ \w+)\)"
    answer = re.search(sentence, section)
    assert answer, "docs/planner.md's sentence on a smaller budget has changed form: update this test with it"
    return argv[3:], table, answer


def _rows(text: str) -> dict[str, list[str]]:
    """``label -> [batch/replica, micro-batch, device peak, host/node, fits]`` of a planner table."""
    out = {}
    for line in text.splitlines():
        if line.startswith("pp ") and " ms " in line:
            cells = re.split(r"\s{2,}", line.strip())
            out[cells[0]] = cells[1:6]
    return out


def test_the_planner_page_quotes_what_the_planner_prints(capsys, monkeypatch):
    # docs/planner.md's table is the command's own output (regenerate it with that command when the planner
    # or CharLM changes): the step times are this machine's, measured anew each run, so the test checks
    # what does not depend on them: the heading, and each quoted row's batches, peaks and fit.
    argv, table, answer = _planner_page()
    monkeypatch.chdir(ROOT)
    assert main([*argv, "--rows", "0", *GIVEN_LINKS]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == table.splitlines()[0]
    quoted, printed = _rows(table), _rows(out)
    differ = {
        label: (cells, printed.get(label)) for label, cells in quoted.items() if printed.get(label) != cells
    }
    assert quoted and not differ, differ
    assert "<- chosen" in table and re.search(r"^    PipelineStrategy\(", table, re.M)
    budget, config, peak = answer.groups()
    assert printed[config][2] == peak and parse_bytes(peak.replace(" ", "")) <= 0.9 * parse_bytes(budget)
