"""The experiments' harness and scripts, at their smallest: the logic, never a real benchmark.

- The method of every timing (``experiments/_repeats.py``): interleaving order, samples, per-repeat
  ratios, medians and ranges, and docs/results.md's wording ("within noise").
- The harness (``experiments/_harness.py``): CSV and PNG writing, the machine record, the parser (its
  multi-process runs are ``lightning_parallel/_testing.py``'s, tested in ``test_harness.py``).
- The scripts' row building from synthetic samples, ``train_charlm.py``'s JSON summary (and the docs'
  quotes of it that ``--refresh-docs`` rewrites, ``_demo_summary.py``), and every script's ``--quick``
  run end to end, all in one process (``tests/scripts/experiments_quick.py``; a script the suite does
  not run fails ``test_every_experiment_script_runs_in_the_suite``), with values that hold whatever the
  machine's speed where a script has them (the hand loop and the Trainer compute the same losses; a
  pipeline rank holds a fraction of DDP's bytes; gpu_check's runs equal one device's).
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from mp_harness import script_env

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


@pytest.fixture(scope="module")
def ex() -> ModuleType:
    """The experiments' modules, imported as a script run from the repository root sees them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXPERIMENTS))
        names = ("_repeats", "_harness", "bench_metric_sync", "bench_pipeline", "scaling_charlm")
        names += ("bench_hf_pipeline", "bench_compile", "bench_trace_share", "refresh_outputs")
        yield _namespace({n: importlib.import_module(n) for n in names})


def _namespace(modules: dict[str, ModuleType]) -> ModuleType:
    ns = ModuleType("experiments_under_test")
    for name, module in modules.items():
        setattr(ns, name.lstrip("_"), module)
    return ns


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------ the method


def test_order_alternates_two_variants_and_rotates_three(ex):
    assert [ex.repeats.order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert [ex.repeats.order(["a", "b", "c"], r) for r in range(3)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
    ]


def test_interleave_runs_abab_with_warmup_and_before_each(ex):
    calls: list[str] = []
    lined_up: list[int] = []

    def variant(name: str, value: float):
        return lambda: calls.append(name) or {"ms": value}

    variants = {"a": variant("a", 10.0), "b": variant("b", 5.0)}
    samples = ex.repeats.interleave(variants, 5, before_each=lambda: lined_up.append(1), warmup=True)
    warmup, timed = calls[:2], calls[2:]
    assert warmup == ["a", "b"]
    assert timed == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert len(lined_up) == len(calls)
    assert [(s["repeat"], s["variant"], s["position"]) for s in samples[:4]] == [
        (0, "a", 0),
        (0, "b", 1),
        (1, "b", 0),
        (1, "a", 1),
    ]
    assert all(s["ms"] == (10.0 if s["variant"] == "a" else 5.0) for s in samples)
    assert ex.repeats.interleave({"x": lambda: 2.5}, 1)[0]["value"] == 2.5
    with pytest.raises(ValueError, match="repeats >= 1"):
        ex.repeats.interleave(variants, 0)


def test_compare_takes_ratios_within_each_repeat(ex):
    """A drift that slows both variants alike moves the absolute times, not the per-repeat ratio."""
    drift = [1.0, 1.5, 0.8, 2.0, 1.2]
    samples = [
        {"repeat": r, "variant": v, "position": 0, "ms": base * d}
        for r, d in enumerate(drift)
        for v, base in (("base", 10.0), ("new", 5.0))
    ]
    base, new = ex.repeats.compare(samples, "ms", baseline="base")
    assert (new["variant"], new["repeats"]) == ("new", 5)
    assert (new["ms"], new["ms_min"], new["ms_max"]) == (6.0, 4.0, 10.0)
    assert new["ratio"] == new["ratio_min"] == new["ratio_max"] == 0.5
    assert base["ratio"] == 1.0
    assert ex.repeats.spread([3.0, 1.0, 2.0]) == ex.repeats.Spread(2.0, 1.0, 3.0, 3)
    with pytest.raises(ValueError, match="no values"):
        ex.repeats.spread([])


@pytest.mark.parametrize(
    ("lo", "hi", "kw", "expected"),
    [
        (0.89, 0.99, {"goal": 0.95}, "within noise"),
        (0.97, 1.02, {"goal": 0.95}, "within noise"),
        (0.96, 0.99, {"goal": 0.95}, "meets the goal in every repeat"),
        (0.80, 0.90, {"goal": 0.95}, "misses the goal in every repeat"),
        (0.90, 1.10, {}, "within noise"),
        (1.20, 1.90, {}, "better in every repeat"),
        (0.02, 0.06, {"higher_is_better": False, "words": ("cheaper", "dearer")}, "cheaper in every repeat"),
        (1.10, 1.40, {"higher_is_better": False, "words": ("cheaper", "dearer")}, "dearer in every repeat"),
    ],
)
def test_verdict_says_within_noise_when_the_range_crosses_parity_or_the_goal(ex, lo, hi, kw, expected):
    assert ex.repeats.verdict(lo, hi, **kw) == expected


# ---------------------------------------------------------------------------------- the harness


def test_csv_png_and_machine_record(ex, tmp_path):
    h = ex.harness
    path = h.write_csv(tmp_path / "x.csv", [{"k": 1, "ms": 2.5}, {"k": 2, "ms": 3.5, "extra": "y"}])
    assert h.read_csv(path) == [{"k": "1", "ms": "2.5", "extra": ""}, {"k": "2", "ms": "3.5", "extra": "y"}]
    with pytest.raises(ValueError, match="no rows to write"):
        h.write_csv(tmp_path / "empty.csv", [])
    fig, ax = h.figure()
    rows = [{"ms": 2.0, "ms_min": 1.0, "ms_max": 4.0}, {"ms": 3.0, "ms_min": 2.5, "ms_max": 3.5}]
    h.errorbars(ax, [1, 2], rows, "ms", label="x")
    assert h.save_figure(fig, tmp_path / "x.png").stat().st_size > 1000
    h.record_machine("one", tmp_path, load="1.5")
    h.record_machine("two", tmp_path)
    h.record_machine("one", tmp_path, load="0.5")
    machine = h.read_csv(tmp_path / "machine.csv")
    assert (machine[0]["experiment"], machine[0]["load_avg_1min"]) == ("one", "0.5")
    assert [r["experiment"] for r in machine] == ["one", "two"]
    assert list(machine[0]) == h.MACHINE_FIELDS and machine[1]["cores"] == str(os.cpu_count())


def test_parser_refuses_a_repeat_count_that_is_not_positive(ex, capsys):
    args = ex.harness.parser("doc").parse_args(["--repeats", "7", "--quick"])
    assert (args.repeats, args.quick, args.out_dir) == (7, True, ex.harness.RESULTS)
    with pytest.raises(SystemExit):
        ex.harness.parser("doc").parse_args(["--repeats", "0"])
    assert "must be a positive whole number of repeats, got '0'" in capsys.readouterr().err
    assert not hasattr(ex.harness.parser("doc", repeats=None).parse_args([]), "repeats")


# ------------------------------------------------------------------------- the scripts' logic


def test_metric_sync_rows_take_overhead_and_ratios_per_repeat(ex):
    fits = [
        {"repeat": r, "variant": v, "position": 0, "k": 8, "step_ms": ms + r, "collectives_per_step": c}
        for r in range(5)
        for v, ms, c in (("none", 10.0, 0), ("all_reduced_metrics", 11.0, 1), ("sync_dist", 30.0, 16))
    ]
    rows = {r["mode"]: r for r in ex.bench_metric_sync.fit_rows(fits)}
    assert set(rows) == {"all_reduced_metrics", "sync_dist"}
    arm = rows["all_reduced_metrics"]
    assert (arm["overhead_ms"], arm["overhead_ms_min"], arm["overhead_ms_max"]) == (1.0, 1.0, 1.0)
    assert (arm["no_sync_step_ms"], arm["no_sync_step_ms_min"], arm["no_sync_step_ms_max"]) == (
        12.0,
        10.0,
        14.0,
    )
    assert rows["sync_dist"]["collectives_per_step"] == 16 and arm["repeats"] == 5
    reductions = [
        {"repeat": r, "variant": v, "position": 0, "k": 8, "step_us": us, "per_metric_us": us / 8}
        | {"collectives_per_step": c}
        for r in range(5)
        for v, us, c in (("all_reduced_metrics", 200.0, 1), ("sync_dist", 800.0, 16))
    ]
    red = {r["mode"]: r for r in ex.bench_metric_sync.reduce_rows(reductions)}
    assert red["all_reduced_metrics"]["ratio_vs_sync_dist"] == 0.25
    assert red["sync_dist"]["per_metric_us"] == 100.0


def test_scaling_rows_read_the_ratio_within_each_repeat(ex):
    sc = ex.scaling_charlm
    samples = [
        {"repeat": r, "variant": name, "position": 0, "samples_per_s": sps * (1 + r / 10), "wall_s": 10.0}
        | {"train_loss": 2.5, "val_loss": 2.6, "optimizer_steps": 40, "global_batch_size": 32}
        | {"threads_per_process": 1}
        for r in range(5)
        for name, sps in (("single", 100.0), ("ddp", 180.0))
    ]
    rows = sc.result_rows([sc.RUNS["single"], sc.RUNS["ddp"]], samples)
    assert [r["run"] for r in rows] == ["1 process", "2 x DDP"]
    ddp = rows[1]
    assert ddp["ratio_vs_1_process"] == ddp["ratio_vs_1_process_min"] == ddp["ratio_vs_1_process_max"] == 1.8
    assert (ddp["samples_per_s_min"], ddp["samples_per_s_max"], ddp["samples"]) == (180.0, 252.0, 1280)


def test_hf_pipeline_rows_take_each_variant_from_its_rank_and_ratios_per_repeat(ex):
    hf = ex.bench_hf_pipeline

    def sample(rep: int, variant: str, sps: float) -> dict:
        return {"repeat": rep, "variant": variant, "position": 0, "samples_per_s": sps, "step_ms": 1e3 / sps}

    one = [{**sample(r, "one_process", 10.0 * (1 + r)), "losses": [2.0, 1.5]} for r in range(5)]
    pipe = [{**sample(r, "pipeline", 15.0 * (1 + r)), "losses": [2.0, 1.5 + 1e-6]} for r in range(5)]
    # Rank 0 measured one process (and idled through the pipeline's clock); rank 1 the pipeline's loss.
    rank0 = one + [{**s, "losses": [float("nan")] * 2} for s in pipe]
    rank1 = [{"repeat": r, "variant": "one_process", "position": 0} for r in range(5)] + pipe
    rows = {r["variant"]: r for r in hf.result_rows(hf.measured([rank0, rank1]), 2, 4)}
    assert rows["pipeline"]["ratio"] == rows["pipeline"]["ratio_min"] == rows["pipeline"]["ratio_max"] == 1.5
    assert float(rows["pipeline"]["max_loss_diff"]) == pytest.approx(1e-6, rel=1e-2)
    assert (rows["pipeline"]["ideal_ratio"], rows["one_process"]["ideal_ratio"]) == (1.6, 1)
    # A step without a loss shows as NaN instead of vanishing in max().
    nan = hf.result_rows([*one, *[{**s, "losses": [2.0, float("nan")]} for s in pipe]], 2, 4)
    assert nan[1]["max_loss_diff"] == "nan"


def test_trace_share_rows_sum_cpu_over_ranks_and_take_the_slowest_first_step(ex):
    ts = ex.bench_trace_share

    def sample(rep: int, variant: str, rank: int) -> dict:
        shared = variant == "gpt/shared"
        cpu = (2.0 if rank == 0 else 0.5) if shared else 2.0
        mb = 0.15 if shared and rank == 0 else 0.0
        return {"repeat": rep, "variant": variant, "position": 0, "trace_cpu_s": cpu, "setup_cpu_s": cpu + 1,
                "first_step_s": 3.0 + rank + rep, "exports": int(rank == 0 or not shared),
                "received": int(rank > 0 and shared), "program_mb": mb}  # fmt: skip

    ranks = [
        [sample(r, v, rank) for r in range(5) for v in ("gpt/every_rank", "gpt/shared")] for rank in range(2)
    ]
    fits = ts.per_node(ranks, 2)
    assert len(fits) == 10 and fits[1]["first_step_s"] == 4.0 and fits[1]["trace_cpu_s"] == 2.5
    rows = {r["variant"]: r for r in ts.result_rows(fits)}
    shared, every = rows["shared"], rows["every_rank"]
    assert (every["trace_cpu_s"], shared["trace_cpu_s"], shared["trace_cpu_s_ratio"]) == (4.0, 2.5, 0.625)
    assert shared["first_step_s_ratio"] == shared["first_step_s_ratio_max"] == 1.0
    assert (shared["exports"], shared["received"], every["exports"]) == (1, 1, 2)


def test_compile_rows_take_ratios_per_repeat_and_the_cold_compile_apart(ex):
    bc = ex.bench_compile
    args = {"workloads": ["demo"], "repeats": 3, "sizes": {}}

    def sample(rep: int, variant: str, step_ms: float, compile_s: float) -> dict:
        losses = [2.0, 1.5 + (1e-6 if variant == "compiled" else 0.0)]
        return dict(repeat=rep, variant=variant, position=0, step_ms=step_ms, compile_s=compile_s,
                    losses=losses, workload="demo")  # fmt: skip

    # the first compiled fit compiles cold (30 s), the later ones warm; rank 0 compiled a little faster
    last = [
        s
        for r in range(3)
        for s in (sample(r, "eager", 100.0, 0.0), sample(r, "compiled", 80.0, 30.0 if r == 0 else 2.0))
    ]
    first = [dict(s, compile_s=s["compile_s"] / 2) for s in last]
    rows = {r["variant"]: r for r in bc.rows_of(args, [first, last])}
    compiled = rows["compiled"]
    assert compiled["ratio"] == compiled["ratio_min"] == compiled["ratio_max"] == 0.8
    assert (compiled["first_compile_s"], compiled["compile_s_min"], compiled["compile_s_max"]) == (
        30.0,
        2.0,
        30.0,
    )
    assert compiled["break_even_steps"] == 1500  # 30 s over 20 ms saved per step
    assert float(compiled["max_loss_diff"]) == pytest.approx(1e-6, rel=1e-2)
    assert rows["eager"]["ratio"] == 1.0 and rows["eager"]["break_even_steps"] == ""


def test_train_charlm_shows_its_steps_without_library_warnings_and_writes_its_json_summary(tmp_path):
    summary, docs = tmp_path / "summary.json", tmp_path / "docs_root"
    (docs / "docs").mkdir(parents=True)
    for page in ("README.md", "docs/demo.md"):  # copies, whose quotes of the demo the run rewrites
        (docs / page).write_text((ROOT / page).read_text())
    cmd = [sys.executable, str(EXPERIMENTS / "train_charlm.py"), "--devices", "1", "--strategy", "auto"]
    cmd += ["--max-steps", "3", "--val-every", "3", "--dim", "16", "--depth", "1", "--seq-len", "16"]
    cmd += ["--global-batch-size", "4", "--text-bytes", "40000", "--out", str(tmp_path / "run")]
    cmd += ["--summary", str(summary), "--sample-bytes", "20", "--refresh-docs", str(docs)]
    env = script_env(ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(summary.read_text())
    assert (data["optimizer_steps"], data["global_batch_size"], data["samples"]) == (3, 4, 12)
    assert data["samples_per_s"] > 0 and data["wall_s"] >= data["fit_seconds"] > 0
    assert math.isfinite(data["train_loss"]) and math.isfinite(data["val_loss"])
    assert Path(data["log_csv"]).exists() and Path(data["checkpoint"]).exists()
    # What the user sees: the steps out of the run's (not Lightning's "Epoch 0/-2" and v_num), and none
    # of the FutureWarnings Lightning raises under torch 2.13 (the script filters them, with the reason).
    shown = proc.stdout + proc.stderr
    assert "Steps" in shown and " 3/3 " in shown and "Epoch 0/-2" not in shown and "v_num" not in shown
    assert "LeafSpec" not in shown and "FutureWarning" not in shown
    # The docs' quotes of the demo, rewritten from this run between their markers, nothing else.
    sample_lines = len(data["sample"].splitlines())  # demo.md: the summary, its paths in one line, the sample
    for page, shown_lines in (("README.md", 5), ("docs/demo.md", 6 + 1 + 2 + sample_lines)):
        before, after = (ROOT / page).read_text(), (docs / page).read_text()
        head, quote, tail = re.split(r"<!-- demo:start -->\n|<!-- demo:end -->", after)
        assert before.startswith(head) and before.endswith(tail)
        assert "optimizer steps     3 x 4 samples\nfinal" in quote  # (README: no train loss line)
        assert f"samples per second  {data['samples_per_s']:.1f}\n" in quote and str(tmp_path) not in quote
        assert re.search(r"^What it printed .*load average \d+\.\d when it started; training \d+ s", quote)
        assert len(re.search(r"```text\n(.*)```", quote, re.S).group(1).splitlines()) == shown_lines
    assert data["sample"] in (docs / "docs/demo.md").read_text()


def test_refresh_outputs_pastes_what_the_command_above_prints_and_nothing_else(ex, tmp_path):
    page = tmp_path / "page.md"
    text = (
        "# Page\n\n```bash\npython -c \\\n    'print(6 * 7); print(\"line 2\")'\n```\n\nIt prints:\n\n"
        "<!-- output of the command above -->\n```text\nold\n```\n\nAfter.\n"
    )
    page.write_text(text)
    assert ex.refresh_outputs.refresh(page, tmp_path) == 1
    assert page.read_text() == text.replace("```text\nold\n```", "```text\n42\nline 2\n```")
    page.write_text(text.replace("print(6 * 7)", "print(6 * 7); 1 / 0"))
    with pytest.raises(SystemExit, match=r"(?s)failed \(1\):\n42\n.*ZeroDivisionError"):
        ex.refresh_outputs.refresh(page, tmp_path)
    assert "```text\nold\n```" in page.read_text()  # a failed command leaves the page as it was


# ------------------------------------------------------------- every script's --quick, end to end

# Every experiment script's --quick run, in ONE process (tests/scripts/experiments_quick.py): the imports
# and the forkserver its ranks fork from are paid once, not once per script. The arguments beside
# --quick: bench_pipeline's two repeats (its order alternates), gpu_check on this CPU, scaling_charlm's
# runs (each a train_charlm.py process of its own).
QUICK = {
    "accumulation_equivalence": [],
    "bench_autoplan": [],
    "bench_checkpoint": [],
    "bench_compile": [],
    "bench_dcp_faults": [],
    "bench_fsdp_memory": [],
    "bench_gpt_pipeline": [],
    "bench_hf_pipeline": [],
    "bench_long_context": ["--repeats", "1"],
    "bench_metric_sync": [],
    "bench_offload": [],
    "bench_overlap": [],
    "bench_pipeline": ["--repeats", "2"],
    "bench_pipeline_memory": [],
    "bench_schedules": [],
    "bench_tensor_parallel": [],
    "bench_trace_share": [],
    "bench_varlen": [],
    "bench_watchdog": [],
    "eight_way_fsdp": [],
    "gpu_check": ["--accelerator", "cpu", "--devices", "1"],
    "hf_pretrained_memory": [],
    "offload_capacity": [],
    # (the 2 x DDP run too would start two more interpreters: ~15 s of CPU, for DDP, which Lightning tests)
    "scaling_charlm": ["--runs", "single", "pipeline"],
}
# The scripts run elsewhere in the suite, and where.
ELSEWHERE = {
    "memory_validation": "tests/test_memory_validation.py (--quick)",
    "train_charlm": "test_train_charlm_shows_its_steps_without_library_warnings_and_writes_its_json_summary",
    "run_all": "tests/test_run_all.py (--skip-run)",
    "refresh_outputs": "test_refresh_outputs_pastes_what_the_command_above_prints_and_nothing_else",
    "gpu_offload_tiers": "a GPU machine, beside gpu_check.py (tests/test_offload_disk.py and "
    "test_offload_shards.py check its mechanics here)",
}
# They write nothing: eight_way_fsdp's rank 0 asserts that every rank holds the stage table's bytes (its
# failure fails the run), gpu_check prints its differences from one device (checked below).
NO_FILES = {"eight_way_fsdp", "gpu_check"}


def test_every_experiment_script_runs_in_the_suite():
    helpers = {"models", "hf_decoders"}  # (as tests/test_module_map.py tells scripts from helpers)
    scripts = {
        p.stem for p in EXPERIMENTS.glob("*.py") if not p.name.startswith("_") and p.stem not in helpers
    }
    assert scripts == set(QUICK) | set(ELSEWHERE), (
        f"not run by the suite: {sorted(scripts - set(QUICK) - set(ELSEWHERE))}; gone: "
        f"{sorted(set(QUICK) | set(ELSEWHERE) - scripts)}. Give a new script a --quick path (tiny: a step or "
        "two of a tiny model) and add it to QUICK"
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, dict]:
    """Every QUICK script run; its output folder and the runner's summary (seconds, error)."""
    out = tmp_path_factory.mktemp("quick")
    summary = out / "summary.json"
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "experiments_quick.py"), str(out), str(summary)]
    cmd += [" ".join([name, *extra]) for name, extra in QUICK.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=script_env(ROOT), cwd=ROOT)
    assert proc.returncode == 0 and summary.exists(), (
        f"the runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return out, json.loads(summary.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # (the first one runs the whole group: the fixture)
@pytest.mark.parametrize("script", list(QUICK))
def test_quick_run(quick, script):
    out, summary = quick
    assert script in summary, f"{script} did not run: the runner stopped before it"
    assert summary[script]["error"] is None, f"{script} --quick failed:\n{summary[script]['error']}"
    printed = (out / script / "stdout.txt").read_text()
    if script in NO_FILES:
        return
    tables = sorted((out / script).glob("*.csv"))
    assert tables, f"{script} wrote no CSV; it printed:\n{printed[-2000:]}"
    assert all(_rows(t) for t in tables), [t.name for t in tables if not _rows(t)]


def test_gpu_check_quick_matches_one_device(quick):
    out, summary = quick
    assert summary["gpu_check"]["error"] is None, summary["gpu_check"]["error"]
    diffs = re.findall(
        r"max \|param diff\| vs one device = ([0-9.e+-]+)", (out / "gpu_check" / "stdout.txt").read_text()
    )
    # The pipeline, then the checks one device runs (gpu_check.checks: four offloads; the replicas' overlap
    # and sequence parallelism need two devices).
    assert len(diffs) == 5 and all(float(d) < 1e-4 for d in diffs), diffs


def test_autoplan_quick_times_fsdp2_and_tensor_parallelism_in_place_on_two_ranks(quick):
    """plan="auto" on the split-qkv CharLM's 2 ranks: FSDP2's units and tensor parallelism's block timed
    in place (techniques/tensor_parallel/timing.py on the job's mesh), not the links' formula it falls
    back to where a measurement fails."""
    out, summary = quick
    assert summary["bench_autoplan"]["error"] is None, summary["bench_autoplan"]["error"]
    printed = (out / "bench_autoplan" / "stdout.txt").read_text()
    noted = re.search(r"what plan='auto' noted: (.*)", printed)
    assert noted, printed[-2000:]
    for technique in ("fsdp", "tensor_parallel"):
        assert f"{technique} measured in place" in noted.group(1), noted.group(1)


def test_hf_pretrained_memory_quick_holds_half_the_model_per_stage(quick):
    out, _ = quick
    rows = {
        r["variant"]: float(r["held_mib"])
        for r in _rows(out / "hf_pretrained_memory" / "hf_pretrained_memory.csv")
    }
    whole = rows.pop("whole model")
    assert set(rows) == {"stage 0 of 2", "stage 1 of 2"} and all(
        0.3 * whole < v < 0.7 * whole for v in rows.values()
    )


def test_bench_pipeline_quick(quick):
    out, _ = quick
    out, stdout = out / "bench_pipeline", (out / "bench_pipeline" / "stdout.txt").read_text()
    overhead = _rows(out / "pipeline_overhead.csv")
    assert [r["first"] for r in overhead] == ["hand", "trainer"]  # the order alternates
    for row in overhead:
        hand, trainer = float(row["hand_samples_per_s"]), float(row["trainer_samples_per_s"])
        assert hand > 0 and trainer > 0
        assert math.isclose(float(row["ratio"]), trainer / hand, rel_tol=1e-3)
        # Same weights, same batches, same schedule: the hand loop and the Trainer train identically.
        assert float(row["max_loss_diff"]) < 1e-4

    sweep = _rows(out / "pipeline_microbatches.csv")
    kinds = {(r["kind"], r["schedule"], int(r["num_microbatches"])) for r in sweep}
    for m in (1, 4, 16):
        assert {("pipeline", "gpipe", m), ("pipeline", "1f1b", m), ("single", "-", m)} <= kinds
    assert ("single_alone", "-", 1) in kinds
    for r in sweep:
        m = int(r["num_microbatches"])
        assert float(r["samples_per_s_min"]) <= float(r["samples_per_s"]) <= float(r["samples_per_s_max"])
        assert math.isclose(float(r["ideal_bubble_efficiency"]), m / (m + 1), rel_tol=1e-3)
        if r["kind"] == "pipeline":
            assert 0 < float(r["efficiency_min"]) <= float(r["efficiency"]) <= float(r["efficiency_max"]) < 10
    assert (out / "pipeline_microbatches.png").stat().st_size > 10_000
    assert "parallelism" in stdout
    assert [r["experiment"] for r in _rows(out / "machine.csv")] == ["pipeline"]


def test_bench_pipeline_memory_quick(quick):
    out, _ = quick
    out = out / "bench_pipeline_memory"
    rows = _rows(out / "pipeline_memory.csv")
    runs = {r["run"]: [x for x in rows if x["run"] == r["run"]] for r in rows}
    assert [(v[0]["strategy"], int(v[0]["world_size"])) for v in runs.values()] == [
        ("ddp", 2),
        ("pipeline", 2),
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
    assert (out / "pipeline_memory.png").stat().st_size > 10_000
