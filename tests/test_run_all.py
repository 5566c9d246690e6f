"""experiments/run_all.py: the results block of docs/results.md is rebuilt from the CSVs, and only that block.

No benchmark runs here: the tables are built from the committed CSVs in experiments/results/ (copied to a
temporary directory, so the test never writes into the repository), and the run loop is exercised with
stand-in scripts. Every number in the block must come from a CSV, and every timing must show its range.
Each table's key columns and whether it shows timings are read from the experiment's own declaration
(its script's ``RESULTS``, experiments/_tables.py), as run_all.py finds them.
"""

from __future__ import annotations

import bisect
import csv
import functools
import importlib
import io
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")
START, END = "<!-- results:start -->", "<!-- results:end -->"


@pytest.fixture(scope="module")
def run_all():
    """experiments/run_all.py, imported as ``python experiments/run_all.py`` sees its neighbours."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "experiments"))
        yield importlib.import_module("run_all")


PAGE_STUB = "# Results\n\nIntro text.\n\n{start}\nstale\n{end}\n\n## After\n\nMore text.\n"


def _page_with_markers(run_all, tmp_path: Path) -> Path:
    """A copy of the real docs/results.md (where run_all.py writes), with the markers it must hold."""
    assert run_all.PAGE == ROOT / "docs" / "results.md"
    text = run_all.PAGE.read_text()
    assert text.count(run_all.START) == 1 and text.count(run_all.END) == 1, "docs/results.md lost its markers"
    path = tmp_path / "results.md"
    path.write_text(text)
    return path


def _results_copy(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("*.png", "*.md"))
    for png in RESULTS.glob("*.png"):
        (out / png.name).touch()
    return out


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _outside(text: str) -> tuple[str, str]:
    head, rest = text.split(START)
    return head, rest.split(END, 1)[1]


def _block(text: str) -> str:
    return text.split(START)[1].split(END)[0]


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


def _allowed(results: Path) -> tuple[set[str], list[tuple[float, ...]]]:
    """Number tokens of every CSV cell (for dates, versions, names) and every value the block may show,
    sorted per CSV (each CSV's share is cached: one merged list would be sorted again for every change)."""
    tokens: set[str] = set()
    values: list[tuple[float, ...]] = []
    for path in results.glob("*.csv"):
        file_tokens, file_values = _allowed_in(path.name, path.read_text())
        tokens |= file_tokens
        values.append(file_values)
    return tokens, values


@functools.lru_cache(maxsize=256)
def _allowed_in(name: str, text: str) -> tuple[frozenset[str], tuple[float, ...]]:
    """One CSV's share of :func:`_allowed`, cached by its content (the tests change one file at a time)."""
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    if not rows:
        return frozenset(), ()
    tokens = {t for r in rows for cell in r.values() for t in NUMBER.findall(cell or "")}
    aggregates = _aggregates(rows)
    values = aggregates + [v / 2**20 for v in aggregates]
    if name == "accumulation_equivalence.csv":
        values += _loss_diffs(rows)
    return frozenset(tokens), tuple(sorted(values))


def _matches(token: str, sorted_values: list[tuple[float, ...]]) -> bool:
    """Whether ``token``, as rounded, is one of the values (each tuple sorted)."""
    x = float(token)
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    tol = 0.5 * 10 ** (int(exponent or 0) - decimals) * 1.0001 + 1e-12
    for values in sorted_values:
        i = bisect.bisect_left(values, x - tol)
        if i < len(values) and values[i] <= x + tol:
            return True
    return False


def _unexplained_numbers(block: str, results: Path) -> list[str]:
    text = re.sub(r"\]\([^)]*\)", "]", block)  # link targets (file names) are not numbers
    tokens, values = _allowed(results)
    return [t for t in NUMBER.findall(text) if t not in tokens and not _matches(t, values)]


# -------------------------------------------------------------------------------------------- tests


def test_skip_run_rewrites_only_the_block(run_all, tmp_path):
    page, results = _page_with_markers(run_all, tmp_path), _results_copy(tmp_path)
    before = page.read_text()
    args = ["--skip-run", "--page", str(page), "--results", str(results)]
    cmd = [sys.executable, str(ROOT / "experiments" / "run_all.py"), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    after = page.read_text()
    assert _outside(after) == _outside(before)
    block = _block(after)
    for _, section in run_all.SECTIONS:
        assert f"\n## {section.title}\n" in block
    for name in (p.stem for p in RESULTS.glob("*.csv") if p.stem != "scaling_charlm_curves"):
        if (RESULTS / f"{name}.png").exists():
            assert f"(results/{name}.png)" in block, name
    assert "No results yet" not in block
    # One machine is named once; results from several machines name each experiment's own.
    common, ran = run_all.machine_lines(results)
    assert "_Ran on " in block and (common in block if common else all(r in block for r in ran.values()))
    # Rebuilding again (in this process) changes nothing.
    run_all.main(args)
    assert page.read_text() == after


def test_every_number_in_the_block_comes_from_a_csv(run_all, tmp_path):
    results = _results_copy(tmp_path)
    run_all.backfill_machines(results)
    block = run_all.build_block(results, tmp_path)
    assert block.count("|") > 100
    assert _unexplained_numbers(block, results) == []
    # The check itself catches a number that no CSV holds.
    assert _unexplained_numbers(block + "\n| 1234.5 |", results) == ["1234.5"]


def _tables(run_all) -> dict:
    """Every table the experiments declare, by its CSV's name."""
    return {table.name: table for _, section in run_all.SECTIONS for table in section.tables}


def _scaled(value: str) -> str:
    return f"{float(value) * 3 + 0.125:.6g}" if value else ""


def test_each_table_follows_its_csv(run_all, tmp_path):
    """Changing one key column of a CSV changes its table, and the new numbers come from the CSV."""
    results = _results_copy(tmp_path)
    for name, declared in _tables(run_all).items():
        builder, path = declared.build, results / f"{name}.csv"
        original = _read(path)
        assert declared.key_columns, f"{name}: declare the key columns its table shows"
        for column in declared.key_columns:
            changed = [
                r | {column: f"{float(r[column]) * 3 + 0.125:.6g}" if r[column] else ""} for r in original
            ]
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(original[0]))
                writer.writeheader()
                writer.writerows(changed)
            table = builder(_read(path))
            assert table != builder(original), (name, column)
            assert _unexplained_numbers(table, results) == [], (name, column)


def test_missing_csv_and_missing_markers(run_all, tmp_path):
    (tmp_path / "results").mkdir()
    block = run_all.build_block(tmp_path / "results", tmp_path)
    assert block.count("_No results yet: run `python experiments/run_all.py --only ") == sum(
        len(section.tables) for _, section in run_all.SECTIONS
    )
    with pytest.raises(ValueError, match="found 0 start and 0 end markers"):
        run_all.replace_block("# no markers here\n", "x")
    with pytest.raises(ValueError, match="exactly one"):
        run_all.replace_block(f"{run_all.END}\n{run_all.START}\n", "x")
    text = PAGE_STUB.format(start=run_all.START, end=run_all.END)
    assert run_all.replace_block(text, "NEW") == text.replace("stale", "NEW")


def test_a_layout_change_names_the_csv_and_the_function(run_all, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "metric_sync.csv").write_text("k,mode\n1,sync_dist\n")
    with pytest.raises(SystemExit, match=r"metric_sync.csv does not have the layout metric_sync\(\)"):
        run_all.build_block(results, tmp_path)


def test_runs_stream_in_order_and_the_first_failure_stops_everything(run_all, tmp_path, monkeypatch, capfd):
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    results.mkdir()
    (scripts / "ok.py").write_text("print('ok ran')\n")
    (scripts / "bad.py").write_text("import sys\nprint('bad ran')\nsys.exit(3)\n")
    (scripts / "never.py").write_text("print('never ran')\n")
    monkeypatch.setattr(run_all, "HERE", scripts)
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(run_all, "EXPERIMENTS", {"ok": "ok.py", "bad": "bad.py", "never": "never.py"})
    page = tmp_path / "results.md"
    page.write_text(PAGE_STUB.format(start=run_all.START, end=run_all.END))
    before = page.read_text()
    with pytest.raises(SystemExit, match=r"bad.py failed with exit code 3 .*--only bad"):
        run_all.main(["--page", str(page)])
    out = capfd.readouterr().out
    assert "ok ran" in out and "bad ran" in out and "never ran" not in out
    assert page.read_text() == before
    assert [r["experiment"] for r in _read(results / "run_all.csv")] == ["ok"]
    # --only runs just that one, records its time (no total: not a full run), rewrites the block.
    run_all.main(["--only", "never", "--page", str(page)])
    assert "never ran" in capfd.readouterr().out
    assert "stale" not in page.read_text()
    times = _read(results / "run_all.csv")
    assert [r["experiment"] for r in times] == ["ok", "never"]
    assert all(float(r["wall_s"]) >= 0 and r["load_avg_1min"] for r in times)
    assert "`make experiments` took" not in page.read_text()
    # Markers are checked before anything runs.
    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match=r"results\.md: the page needs exactly one"):
        run_all.main(["--only", "ok", "--page", str(page)])
    assert "ok ran" not in capfd.readouterr().out


def test_a_full_run_records_and_states_its_total_time(run_all, tmp_path, monkeypatch):
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    results.mkdir()
    (scripts / "ok.py").write_text("import time\ntime.sleep(0.2)\n")
    monkeypatch.setattr(run_all, "HERE", scripts)
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(run_all, "EXPERIMENTS", {"ok": "ok.py"})
    page = tmp_path / "results.md"
    page.write_text(PAGE_STUB.format(start=START, end=END))
    run_all.main(["--page", str(page)])
    times = {r["experiment"]: r for r in _read(results / "run_all.csv")}
    assert list(times) == ["ok", run_all.ALL]
    assert float(times[run_all.ALL]["wall_s"]) >= float(times["ok"]["wall_s"]) >= 0
    total = times[run_all.ALL]
    assert f"`make experiments` took {total['wall_min']} min in all on {total['date']}" in page.read_text()


# ------------------------------------------------------------------ every timing with its range

# Headers of timing columns: throughputs, times, and ratios or efficiencies built from them.
TIMING_HEADER = re.compile(
    r"samples/s|\bms\b|\bus\b|(?<!')\bs\b|stall|efficiency|overhead|Trainer / hand|/ sync_dist|"
    r"vs one process|vs ModelCheckpoint|vs no sync|ratio|wall",
    re.IGNORECASE,
)
RANGED = re.compile(r"^-?\d+(?:\.\d+)? \(-?\d+(?:\.\d+)? \.\. -?\d+(?:\.\d+)?\)(?:, [a-z ]+)?$")


def _tables_in(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The markdown tables of ``text``: (header, rows of cells)."""
    tables, lines = [], [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            body = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                body.append([c.strip() for c in row.strip("|").split("|")])
            tables.append(([c.strip() for c in line.strip("|").split("|")], body))
    return tables


def _unranged_timings(text: str) -> tuple[int, list[str]]:
    """How many timing columns ``text``'s tables have, and each timing cell that lacks its range."""
    columns, problems = 0, []
    for header, body in _tables_in(text):
        for j, name in enumerate(header):
            if TIMING_HEADER.search(name):
                columns += 1
                problems += [
                    f"{name}: {row[j]}" for row in body if row[j] != "-" and not RANGED.match(row[j])
                ]
    return columns, problems


def test_every_timing_column_in_the_block_comes_with_its_range(run_all, tmp_path):
    results = _results_copy(tmp_path)
    block = run_all.build_block(results, tmp_path)
    columns, problems = _unranged_timings(block)
    assert problems == []
    timed = [table for table in _tables(run_all).values() if table.timed]
    assert len(timed) >= 9
    for table in timed:  # every table declared timed has timing columns the check recognises
        assert _unranged_timings(table.build(_read(results / f"{table.name}.csv")))[0] > 0, table.name
    assert columns >= 20
    # The check itself catches a timing shown without its range.
    bare = block + "\n\n| run | step ms |\n|---|---|\n| x | 12.5 |\n"
    assert _unranged_timings(bare)[1] == ["step ms: 12.5"]


def _with_column(rows: list[dict[str, str]], **columns: list[str]) -> list[dict[str, str]]:
    return [r | {k: v[i % len(v)] for k, v in columns.items()} for i, r in enumerate(rows)]


def test_a_range_across_parity_or_the_goal_is_within_noise(run_all):
    tables = SimpleNamespace(**{name: table.build for name, table in _tables(run_all).items()})
    overhead = _read(RESULTS / "pipeline_overhead.csv")
    noisy = tables.pipeline_overhead(_with_column(overhead, ratio=["0.90", "0.97", "1.02"], goal=["0.95"]))
    assert "0.97 (0.90 .. 1.02), within noise" in noisy
    clear = tables.pipeline_overhead(_with_column(overhead, ratio=["0.96", "0.97", "0.99"], goal=["0.95"]))
    assert "0.97 (0.96 .. 0.99), meets the goal in every repeat" in clear
    scaling = _read(RESULTS / "scaling_charlm.csv")
    crossing = _with_column(scaling, ratio_vs_1_process_min=["0.8"], ratio_vs_1_process_max=["1.3"])
    assert "within noise" in tables.scaling_charlm(crossing)
    above = _with_column(scaling, ratio_vs_1_process_min=["1.1"], ratio_vs_1_process_max=["1.9"])
    assert "faster in every repeat" in tables.scaling_charlm(above)
    saves = _read(RESULTS / "checkpoint_bench.csv")
    stalls = {"ModelCheckpoint (TorchCheckpointIO)": ["1.0"], "Rank0Checkpoint sync": ["0.7", "1.2"]}
    mixed = [
        r | {"stall_vs_model_checkpoint": (v := stalls.get(r["method"], ["0.1"]))[i % len(v)]}
        for i, r in enumerate(saves)
    ]
    assert "within noise" in tables.checkpoint_bench(mixed)


def test_an_experiment_declares_its_tables_in_its_script_and_run_all_finds_it(run_all, tmp_path, monkeypatch):
    """A new script with its ``RESULTS`` is on the page (last, unless PAGE_ORDER places it) with no other
    file changed; two scripts declaring one name, or PAGE_ORDER naming no script, stop run_all."""
    (tmp_path / "bench_new.py").write_text(
        "import _tables as t\n\n\ndef new_csv(rows):\n"
        "    return t.table(['x'], [[r['x']] for r in rows])\n\n\n"
        "RESULTS = t.Results('new', t.Section('A new question', t.Table(new_csv, ('x',))))\n"
    )
    (tmp_path / "helper.py").write_text("RESULTS = 'not a declaration'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = run_all.discover(tmp_path, order=())
    assert list(found) == ["new"] and found["new"][0] == "bench_new.py"
    section = found["new"][1].sections[0]
    assert section.title == "A new question" and section.tables[0].name == "new_csv"
    assert section.tables[0].build([{"x": "1.5"}]) == "| x |\n|---|\n| 1.5 |"
    with pytest.raises(SystemExit, match=r"PAGE_ORDER names \['missing'\]"):
        run_all.discover(tmp_path, order=("missing",))
    (tmp_path / "bench_twin.py").write_text((tmp_path / "bench_new.py").read_text())
    with pytest.raises(SystemExit, match="both declare 'new'"):
        run_all.discover(tmp_path, order=())
    # The real ones: every declared table's CSV is committed, each experiment runs as its script.
    assert all((RESULTS / f"{name}.csv").exists() for name in _tables(run_all))
    assert set(run_all.EXPERIMENTS.values()) <= {p.name for p in (ROOT / "experiments").glob("*.py")}
