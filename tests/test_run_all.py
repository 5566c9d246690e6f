"""experiments/run_all.py: the README results block is rebuilt from the CSVs, and only that block.

No benchmark runs here: the tables are built from the committed CSVs in experiments/results/ (copied to a
temporary directory, so the test never writes into the repository), and the run loop is exercised with
two stand-in scripts.
"""

from __future__ import annotations

import bisect
import csv
import importlib.util
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")

spec = importlib.util.spec_from_file_location("run_all", ROOT / "experiments" / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
sys.modules["run_all"] = run_all  # dataclasses look their module up there
spec.loader.exec_module(run_all)

README_STUB = "# Project\n\nIntro text.\n\n## Results\n\n{start}\nstale\n{end}\n\n## After\n\nMore text.\n"


def _readme_with_markers(tmp_path: Path) -> Path:
    """A copy of the real README, with the markers added at the end if it has none yet."""
    text = (ROOT / "README.md").read_text()
    if run_all.START not in text:
        text += f"\n## Results\n\n{run_all.START}\n{run_all.END}\n"
    path = tmp_path / "README.md"
    path.write_text(text)
    return path


def _results_copy(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("*.png", "*.md"))
    for png in RESULTS.glob("*.png"):
        (out / png.name).touch()
    return out


def _outside(text: str) -> tuple[str, str]:
    head, rest = text.split(run_all.START)
    return head, rest.split(run_all.END, 1)[1]


def _block(text: str) -> str:
    return text.split(run_all.START)[1].split(run_all.END)[0]


# ------------------------------------------------------- the test's own derivation of allowed numbers


def _as_float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def _aggregates(rows: list[dict[str, str]]) -> list[float]:
    """Every value, and median / min / max / count of each column over each group of each column."""
    out: list[float] = []
    groupings: list[list[list[dict[str, str]]]] = [[rows]]
    for key in rows[0]:
        groups: dict[str, list[dict[str, str]]] = {}
        for r in rows:
            groups.setdefault(r[key], []).append(r)
        groupings.append(list(groups.values()))
    for grouping in groupings:
        for group in grouping:
            out.append(len(group))
            for key in rows[0]:
                values = [v for v in (_as_float(r[key]) for r in group) if v is not None]
                if values:
                    out += [statistics.median(values), min(values), max(values)]
    return out


def _loss_diffs(rows: list[dict[str, str]]) -> list[float]:
    """Accumulation: the largest |loss(N devices) - loss(1 device)| over the steps, per schedule."""
    runs: dict[str, list[float]] = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(float(r["loss"]))
    return [
        max(abs(a - b) for a, b in zip(losses, runs["1dev-" + name.split("-", 1)[1]]))
        for name, losses in runs.items()
        if not name.startswith("1dev-")
    ]


def _allowed(results: Path) -> tuple[set[str], list[float]]:
    """Number tokens of every CSV cell (for dates, versions, names) and every value the block may show."""
    tokens: set[str] = set()
    values: list[float] = []
    for path in results.glob("*.csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows:
            continue
        tokens |= {t for r in rows for cell in r.values() for t in NUMBER.findall(cell or "")}
        aggregates = _aggregates(rows)
        values += aggregates + [v / 2**20 for v in aggregates]
        if path.name == "accumulation_equivalence.csv":
            values += _loss_diffs(rows)
    return tokens, sorted(values)


def _matches(token: str, values: list[float]) -> bool:
    x = float(token)
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    tol = 0.5 * 10 ** (int(exponent or 0) - decimals) * 1.0001 + 1e-12
    i = bisect.bisect_left(values, x - tol)
    return i < len(values) and values[i] <= x + tol


def _unexplained_numbers(block: str, results: Path) -> list[str]:
    text = re.sub(r"\]\([^)]*\)", "]", block)  # link targets (file names) are not numbers
    tokens, values = _allowed(results)
    return [t for t in NUMBER.findall(text) if t not in tokens and not _matches(t, values)]


# -------------------------------------------------------------------------------------------- tests


def test_skip_run_rewrites_only_the_block(tmp_path):
    readme, results = _readme_with_markers(tmp_path), _results_copy(tmp_path)
    before = readme.read_text()
    cmd = [sys.executable, str(ROOT / "experiments" / "run_all.py"), "--skip-run"]
    cmd += ["--readme", str(readme), "--results", str(results)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    after = readme.read_text()
    assert _outside(after) == _outside(before)
    block = _block(after)
    for q in run_all.QUESTIONS:
        assert f"### {q.title}" in block
    for name in (p.stem for p in RESULTS.glob("*.csv") if p.stem != "scaling_charlm_curves"):
        if (RESULTS / f"{name}.png").exists():
            assert f"(results/{name}.png)" in block, name
    assert "No results yet" not in block
    assert "Machine: " in block and "_Ran on " in block
    # Rebuilding again changes nothing.
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    assert readme.read_text() == after


def test_every_number_in_the_block_comes_from_a_csv(tmp_path):
    results = _results_copy(tmp_path)
    run_all.backfill_machines(results)
    block = run_all.build_block(results, tmp_path)
    assert block.count("|") > 100
    assert _unexplained_numbers(block, results) == []
    # The check itself catches a number that no CSV holds.
    assert _unexplained_numbers(block + "\n| 1234.5 |", results) == ["1234.5"]


# The key numbers each table must show: changing any one of these columns must change the table.
KEY_COLUMNS = {
    "pipeline_overhead": ["hand_samples_per_s", "trainer_samples_per_s", "ratio", "fast_ratio"],
    "pipeline_microbatches": ["samples_per_s", "efficiency", "ideal_bubble_efficiency"],
    "pipeline_memory": ["ppo_bytes", "ppo_vs_ddp", "activation_peak_bytes", "max_rss_mb"],
    "metric_sync": ["collectives_per_step", "step_ms", "no_sync_step_ms", "overhead_ms"],
    "checkpoint_bench": ["stall_s", "total_s", "extra_mib"],
    "checkpoint_kill": [
        "kills",
        "files_present",
        "files_loadable",
        "files_unloadable",
        "orphans",
        "orphan_mib",
    ],
    "accumulation_equivalence": ["loss"],
    "scaling_charlm": ["samples_per_s", "ratio_vs_1_process", "train_loss", "val_loss", "wall_s"],
}


def _scaled(value: str) -> str:
    return f"{float(value) * 3 + 0.125:.6g}" if value else ""


def test_each_table_follows_its_csv(tmp_path):
    """Changing one key column of a CSV changes its table, and the new numbers come from the CSV."""
    results = _results_copy(tmp_path)
    builders = {b.__name__: b for q in run_all.QUESTIONS for b in q.tables}
    assert set(builders) == set(KEY_COLUMNS)
    for name, builder in builders.items():
        path = results / f"{name}.csv"
        original = run_all.read_csv(path)
        for column in KEY_COLUMNS[name]:
            changed = [
                r | {column: f"{float(r[column]) * 3 + 0.125:.6g}" if r[column] else ""} for r in original
            ]
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(original[0]))
                writer.writeheader()
                writer.writerows(changed)
            table = builder(run_all.read_csv(path))
            assert table != builder(original), (name, column)
            assert _unexplained_numbers(table, results) == [], (name, column)


def test_missing_csv_and_missing_markers(tmp_path):
    (tmp_path / "results").mkdir()
    block = run_all.build_block(tmp_path / "results", tmp_path)
    assert block.count("_No results yet: run `python experiments/run_all.py --only ") == sum(
        len(q.tables) for q in run_all.QUESTIONS
    )
    with pytest.raises(ValueError, match="found 0 start and 0 end markers"):
        run_all.replace_block("# no markers here\n", "x")
    with pytest.raises(ValueError, match="exactly one"):
        run_all.replace_block(f"{run_all.END}\n{run_all.START}\n", "x")
    text = README_STUB.format(start=run_all.START, end=run_all.END)
    assert run_all.replace_block(text, "NEW") == text.replace("stale", "NEW")


def test_a_layout_change_names_the_csv_and_the_function(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "metric_sync.csv").write_text("k,mode\n1,sync_dist\n")
    with pytest.raises(SystemExit, match=r"metric_sync.csv does not have the layout metric_sync\(\)"):
        run_all.build_block(results, tmp_path)


def test_runs_stream_in_order_and_the_first_failure_stops_everything(tmp_path, monkeypatch, capfd):
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    results.mkdir()
    (scripts / "ok.py").write_text("print('ok ran')\n")
    (scripts / "bad.py").write_text("import sys\nprint('bad ran')\nsys.exit(3)\n")
    (scripts / "never.py").write_text("print('never ran')\n")
    monkeypatch.setattr(run_all, "HERE", scripts)
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(run_all, "EXPERIMENTS", {"ok": "ok.py", "bad": "bad.py", "never": "never.py"})
    readme = tmp_path / "README.md"
    readme.write_text(README_STUB.format(start=run_all.START, end=run_all.END))
    before = readme.read_text()
    with pytest.raises(SystemExit, match=r"bad.py failed with exit code 3 .*--only bad"):
        run_all.main(["--readme", str(readme)])
    out = capfd.readouterr().out
    assert "ok ran" in out and "bad ran" in out and "never ran" not in out
    assert readme.read_text() == before
    assert [r["experiment"] for r in run_all.read_csv(results / "machine.csv")] == ["ok"]
    # --only runs just that one, then rewrites the block.
    run_all.main(["--only", "never", "--readme", str(readme)])
    assert "never ran" in capfd.readouterr().out
    assert "stale" not in readme.read_text()
    # Markers are checked before anything runs.
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match=r"README\.md: the README needs exactly one"):
        run_all.main(["--only", "ok", "--readme", str(readme)])
    assert "ok ran" not in capfd.readouterr().out
