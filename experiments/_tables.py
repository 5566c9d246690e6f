"""The results tables of docs/results.md: one function per CSV in ``experiments/results/``, named after it
(``metric_sync()`` reads ``metric_sync.csv``), and :data:`QUESTIONS`, which groups them under a title.

A table shows CSV values, or medians / minima / maxima / counts of a CSV column, or byte counts in MiB:
``tests/test_run_all.py`` checks every number. Every timing goes through :func:`timed` (median and
min-max range; the test checks that each timing column has its range), and a ratio's cell ends with
``_harness.verdict``'s words ("within noise" when its range crosses parity or the goal).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import _harness as h

Rows = list[dict[str, str]]


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _f(value: str | float, digits: int) -> str:
    return f"{float(value):.{digits}f}"


def _groups(rows: Rows, key: str) -> dict[str, Rows]:
    out: dict[str, Rows] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def _mib(value: float) -> str:
    return _f(value / 2**20, 1)


def timed(median: str | float, lo: str | float, hi: str | float, digits: int, verdict: str = "") -> str:
    """A timing cell: the median, its min-max range over the repeats, and the verdict if any.

    Every timing in the block goes through here (``tests/test_run_all.py`` checks that each timing
    column has its range).
    """
    cell = f"{_f(median, digits)} ({_f(lo, digits)} .. {_f(hi, digits)})"
    return f"{cell}, {verdict}" if verdict else cell


def timed_col(row: dict[str, str], key: str, digits: int, verdict: str = "") -> str:
    """:func:`timed` of the CSV columns ``key``, ``key_min``, ``key_max`` of one row."""
    return timed(row[key], row[f"{key}_min"], row[f"{key}_max"], digits, verdict)


def timed_rows(rows: Rows, key: str, digits: int, verdict: str = "") -> str:
    """:func:`timed` of one column over per-repeat rows: their median and range."""
    s = h.spread(float(r[key]) for r in rows)
    return timed(s.median, s.lo, s.hi, digits, verdict)


def _verdict(row: dict[str, str], key: str, **kw: object) -> str:
    return h.verdict(float(row[f"{key}_min"]), float(row[f"{key}_max"]), **kw)


def pipeline_overhead(rows: Rows) -> str:
    r0, goal = rows[0], float(rows[0]["goal"])
    ratios = h.spread(float(r["ratio"]) for r in rows)
    worst = max(rows, key=lambda r: float(r["max_loss_diff"]))["max_loss_diff"]
    cells = [r0["schedule"], r0["num_microbatches"], r0["batch_size"], len(rows)]
    cells += [timed_rows(rows, k, 1) for k in ("hand_samples_per_s", "trainer_samples_per_s")]
    cells += [timed_rows(rows, "ratio", 2, h.verdict(ratios.lo, ratios.hi, goal=goal))]
    cells += [timed_rows(rows, "fast_ratio", 2)]
    header = ["schedule", "micro-batches", "batch", "repeats", "hand samples/s", "Trainer samples/s"]
    header += [f"Trainer / hand (goal {r0['goal']})", "Trainer / hand, fastest steps"]
    note = "\n\nMedians over the repeats, (min .. max) beside them; the ratio is taken within each repeat."
    if "added_ms" in r0:  # the fixed cost per step: the first stage's time outside the schedule
        cells += [timed_rows(rows, k, 2) for k in ("hand_outside_ms", "trainer_outside_ms", "added_ms")]
        header += ["first stage outside the schedule, hand ms", "... Trainer ms", "Trainer adds ms per step"]
        note += (
            " Outside the schedule: the first stage's median time per step from the end of one "
            "`schedule.step()` to the start of the next (the optimizer step and the data in both; "
            "Lightning's loop, its hooks, the log replay and the strategy's Python in the Trainer's); it is "
            "on the critical path, since the last stage has finished its part of the schedule earlier and "
            "waits."
        )
    return _table([*header, "max loss diff"], [[*cells, worst]]) + note


def pipeline_microbatches(rows: Rows) -> str:
    at = {(r["kind"], r["schedule"], r["num_microbatches"]): r for r in rows}
    ms = sorted({r["num_microbatches"] for r in rows if r["kind"] == "pipeline"}, key=int)
    body = []
    for m in ms:
        gpipe, f1b = at[("pipeline", "gpipe", m)], at[("pipeline", "1f1b", m)]
        body.append(
            [m, f1b["repeats"], _f(f1b["ideal_bubble_efficiency"], 3)]
            + [timed_col(x, "efficiency", 3) for x in (f1b, gpipe)]
            + [timed_col(x, "samples_per_s", 1) for x in (f1b, gpipe, at[("single", "-", m)])]
        )
    header = ["micro-batches m", "repeats", "ideal (bubble only)", "1f1b efficiency", "gpipe efficiency"]
    header += ["1f1b samples/s", "gpipe samples/s", "one process samples/s"]
    alone = at[("single_alone", "-", "1")]
    note = (
        f"\n\nEfficiency: pipeline throughput over p x one process with the same micro-batches, in the "
        f"same repeat. Parallelism of the two processes (one process's throughput with both busy over "
        f"alone; near one when each really has a core): {timed_col(alone, 'parallelism', 2)}."
    )
    return _table(header, body) + note


def pipeline_memory(rows: Rows) -> str:
    body = []
    for run, ranks in _groups(rows, "run").items():
        r0 = ranks[0]
        on_meta = all(r["other_stage_params"] == r["other_stage_params_meta"] for r in ranks)
        body.append(
            [
                run,
                r0["world_size"],
                f"{r0['model_dim']} x {r0['model_depth']}",
                _mib(max(float(r["ppo_bytes"]) for r in ranks)),
                _f(max(float(r["ppo_vs_ddp"]) for r in ranks), 3),
                " / ".join(_mib(float(r["activation_peak_bytes"])) for r in ranks),
                "yes" if r0["strategy"] == "pipeline" and on_meta else "-",
                _f(max(float(r["max_rss_mb"]) for r in ranks), 1),
            ]
        )
    header = ["run", "ranks", "width x blocks", "params+grads+AdamW MiB (worst rank)", "vs DDP"]
    header += ["activation peak MiB, rank by rank", "other stages stay on meta", "max RSS MB"]
    return _table(header, body) + "\n\nByte counts: one run each, they do not depend on the load."


def fsdp_memory(rows: Rows) -> str:
    body = []
    for run, ranks in _groups(rows, "run").items():
        ppo = max(ranks, key=lambda r: float(r["ppo_bytes"]))
        peak = max(ranks, key=lambda r: float(r["peak_bytes"]))
        body.append(
            [run, len(ranks), _mib(float(ppo["param_bytes"])), _mib(float(ppo["grad_bytes"])),
             _mib(float(ppo["optimizer_bytes"])), _mib(float(ppo["ppo_bytes"])), _f(ppo["ppo_vs_ddp"], 3),
             _mib(float(peak["peak_bytes"])), _f(peak["peak_vs_ddp"], 3),
             _mib(float(peak["predicted_peak_bytes"])), _f(peak["predicted_error"], 3)]
        )  # fmt: skip
    header = ["run", "ranks", "parameters MiB", "gradients MiB", "AdamW state MiB", "sum MiB (worst rank)"]
    header += ["vs DDP", "peak MiB (worst rank, MemTracker)", "vs DDP", "predicted peak MiB", "error"]
    r0 = rows[0]
    return _table(header, body) + (
        f"\n\n`SequentialCharLM` width {r0['model_dim']}, {r0['model_depth']} blocks, AdamW, global batch "
        f"{r0['global_batch']}, {r0['num_microbatches']} micro-batches; parameters, gradients and state "
        "counted before the second optimizer step (a DTensor: its local shard). Byte counts: one run each, "
        "they do not depend on the load."
    )


def tensor_parallel(rows: Rows) -> str:
    body = [
        [r["run"], r["rank"], _mib(float(r["ppo_bytes"])), _f(r["ppo_vs_dp"], 2),
         timed_col(r, "step_s", 3), _f(r["step_vs_dp"], 2)]
        for r in rows
    ]  # fmt: skip
    header = ["run", "rank", "params+grads+AdamW MiB", "vs pp x dp", "step s (min .. max over steps)"]
    header += ["step vs pp x dp"]
    r0 = rows[0]
    note = (
        f"4 processes, width {r0['model_dim']} x {r0['model_depth']} blocks, "
        f"global batch {r0['global_batch']}; each model against its own replicas. `Sequential`: "
        "`SequentialCharLM` with separate q, k, v, its stage modules running on their local slices; "
        "`HF Llama (traced)`: a `LlamaForCausalLM` from config split with its own `base_model_tp_plan`, "
        "its traced stage graphs running on DTensors (every op dispatched through DTensor's sharding "
        "propagation: part of its step time). Bytes: one run (they do not depend on the load); step times "
        "on 2 shared CPU cores with gloo, where tensor parallelism's per-block all-reduces cost more than "
        "on a GPU node."
    )
    return _table(header, body) + "\n\n" + note


def metric_sync(rows: Rows) -> str:
    at = {(r["k"], r["mode"]): r for r in rows}
    body = []
    for k in sorted({r["k"] for r in rows}, key=int):
        arm, sync = at[(k, "all_reduced_metrics")], at[(k, "sync_dist")]
        words = {"higher_is_better": False, "words": ("below no sync", "above no sync")}
        body.append(
            [k, arm["repeats"], _f(arm["collectives_per_step"], 0), _f(sync["collectives_per_step"], 0)]
            + [
                timed_col(arm, "no_sync_step_ms", 1),
                timed_col(arm, "step_ms", 1),
                timed_col(sync, "step_ms", 1),
            ]
            + [timed_col(x, "overhead_ms", 1, _verdict(x, "ratio_vs_no_sync", **words)) for x in (arm, sync)]
        )
    header = ["metrics K", "repeats", "collectives/step AllReducedMetrics", "collectives/step sync_dist"]
    header += ["step ms, no sync", "step ms AllReducedMetrics", "step ms sync_dist"]
    header += ["overhead ms AllReducedMetrics", "overhead ms sync_dist"]
    return "In a fit (step cycle, overhead against no sync in the same repeat):\n\n" + _table(header, body)


def metric_sync_reduce(rows: Rows) -> str:
    at = {(r["k"], r["mode"]): r for r in rows}
    body = []
    for k in sorted({r["k"] for r in rows}, key=int):
        arm, sync = at[(k, "all_reduced_metrics")], at[(k, "sync_dist")]
        words = {"higher_is_better": False, "words": ("cheaper", "dearer")}
        body.append(
            [
                k,
                arm["repeats"],
                _f(arm["collectives_per_step"], 0),
                _f(sync["collectives_per_step"], 0),
                timed_col(arm, "per_metric_us", 1),
                timed_col(sync, "per_metric_us", 1),
                timed_col(arm, "ratio_vs_sync_dist", 2, _verdict(arm, "ratio_vs_sync_dist", **words)),
            ]
        )
    header = ["metrics K", "repeats", "collectives/step AllReducedMetrics", "collectives/step sync_dist"]
    header += ["us per metric AllReducedMetrics", "us per metric sync_dist", "AllReducedMetrics / sync_dist"]
    intro = "The reduction path alone (same process group, no training), cost per logged metric per step:"
    return f"{intro}\n\n" + _table(header, body)


def checkpoint_bench(rows: Rows) -> str:
    body = []
    for method, saves in _groups(rows, "method").items():
        ratio = h.spread(float(r["stall_vs_model_checkpoint"]) for r in saves)
        baseline = ratio.lo == ratio.hi == 1.0
        goal = saves[0].get("goal") or None
        verdict = h.verdict(
            ratio.lo,
            ratio.hi,
            None if goal is None else float(goal),
            higher_is_better=False,
            words=("shorter", "longer"),
        )

        body.append(
            [method, len(saves)]
            + [timed_rows(saves, k, 2) for k in ("stall_s", "total_s")]
            + [timed_rows(saves, "extra_mib", 1)]
            + ["-" if baseline else timed_rows(saves, "stall_vs_model_checkpoint", 2, verdict)]
        )
    header = ["method", "saves", "training stall s", "save done s", "extra memory MiB"]
    goals = [r["goal"] for r in rows if r.get("goal")]
    ratio = f"stall vs ModelCheckpoint (async goal <= {goals[0]})" if goals else "stall vs ModelCheckpoint"
    return _table([*header, ratio], body)


def checkpoint_kill(rows: Rows) -> str:
    body = [
        [
            r["method"],
            r.get("temp_file", ""),
            os.path.dirname(r["tmpdir"]),
            r["kills"],
            r["files_present"],
            r["files_loadable"],
            r["files_unloadable"],
            r["orphans"],
            _f(r["orphan_mib"], 1),
        ]
        for r in rows
    ]
    header = ["writer", "temp file", "TMPDIR on", "kills", "files present", "loadable", "unloadable"]
    return _table([*header, "temp files left by the kills", "their MiB"], body) + (
        "\n\nLeft behind counts each kill's leftovers before any clean-up (Rank0Checkpoint removes a named "
        "temp file at its next start; an unnamed O_TMPFILE one never appears)."
    )


def dcp_async(rows: Rows) -> str:
    body = []
    for r in rows:
        sync = r["stall_vs_sync"] == r["stall_vs_sync_min"] == r["stall_vs_sync_max"] == "1.0"
        verdict = _verdict(r, "stall_vs_sync", higher_is_better=False, words=("shorter", "longer"))
        ratio = "-" if sync else timed_col(r, "stall_vs_sync", 3, verdict)
        body.append([r["method"], r["size_mb"], r["repeats"], timed_col(r, "stall_s", 3)])
        body[-1] += [timed_col(r, "total_s", 3), ratio]
    header = ["save", "MB per rank", "repeats", "training stall s", "published after s"]
    return _table([*header, "stall vs synchronous"], body) + (
        "\n\nEvery rank writes its own shards; the slower rank's times, interleaved saves, the ratio taken "
        "within each repeat. The background save's stall is the copy into its reused buffers and the "
        "start of the write on the checkpoint group; the rest overlaps training."
    )


def dcp_kill(rows: Rows) -> str:
    header = ["saves", "SIGKILL of", "kills", "directories listed", "complete", "load", "temporary left"]
    header += ["removed at the next start", "resumed runs ending on the uninterrupted weights"]
    keys = ("kills", "listed", "complete", "loadable", "partial_left", "removed_at_start", "exact")
    victims = {"one": "one rank", "both": "both ranks"}
    body = [[r["mode"], victims.get(r["killed"], r["killed"]), *(r[k] for k in keys)] for r in rows]
    return _table(header, body) + (
        "\n\nA Trainer (pipeline of two ranks, a directory every step, Rank0Checkpoint keeping the newest "
        'two) killed at a random instant; after each kill the next run starts with `ckpt_path="last"` '
        "and trains to the end. Counted after every kill, before that start: only complete directories "
        "are ever listed (the temporary ones are hidden `.partial` siblings), and each loads; resumed, "
        "the run ends on the uninterrupted run's weights bit for bit."
    )


def accumulation_equivalence(rows: Rows) -> str:
    runs = _groups(rows, "run")
    body = []
    for run, steps in runs.items():
        # Compare with the 1-device run of the same batch schedule: "2dev-ramp" -> "1dev-ramp".
        ref = runs.get("1dev-" + run.split("-", 1)[-1])
        diff = max(abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(steps, ref or steps))
        batch = f"{steps[0]['global_batch_size']} .. {steps[-1]['global_batch_size']}"
        body.append(
            [
                run,
                steps[0]["devices"],
                len(steps),
                batch,
                _f(steps[0]["loss"], 4),
                _f(steps[-1]["loss"], 4),
                f"{diff:.1e}" if ref is not None and ref is not steps else "-",
            ]
        )
    header = ["run", "devices", "optimizer steps", "global batch", "first loss", "final loss"]
    return _table([*header, "max loss diff vs one device (CSV's 8-digit losses)"], body)


def scaling_charlm(rows: Rows) -> str:
    body = []
    for r in rows:
        single = r["processes"] == "1"
        verdict = "" if single else _verdict(r, "ratio_vs_1_process", words=("faster", "slower"))
        body.append(
            [
                *(r[k] for k in ("run", "processes", "threads_per_process", "samples", "repeats")),
                timed_col(r, "samples_per_s", 1),
                "-" if single else timed_col(r, "ratio_vs_1_process", 2, verdict),
                *(_f(r[k], 3) for k in ("train_loss", "val_loss")),
                timed_col(r, "wall_s", 1),
            ]
        )
    header = ["run", "processes", "threads each", "samples", "repeats", "samples/s", "vs one process"]
    return _table([*header, "final train loss", "val loss", "wall s (incl. start-up)"], body)


def memory_validation(rows: Rows) -> str:
    body = []
    for config, ranks in _groups(rows, "config").items():
        worst = next(r for r in ranks if r["worst_rank"] == "True")
        furthest = max(ranks, key=lambda r: abs(float(r["error"])))
        mib = [_mib(float(worst[k])) for k in ("measured_bytes", "predicted_bytes")]
        body.append([config, len(ranks), *mib, _f(worst["error"], 3), _f(furthest["error"], 3)])
    header = ["run", "ranks", "measured MiB, worst rank (MemTracker)", "predicted MiB", "error"]
    return _table([*header, "error, furthest rank"], body) + (
        f"\n\nerror = predicted / measured - 1, target |error| <= {rows[0]['tolerance']} on the worst rank "
        "(the rank with the largest measured peak). Byte counts do not depend on the load: measured once."
    )


HOST_COLUMNS = ("predicted_host_bytes", "measured_host_bytes")
AUTOPLAN_FAMILIES = ("replicas", "ZeRO-1", "FSDP2", "tensor parallel", "offload", "interleaved", "pipeline")


def autoplan(rows: Rows) -> str:
    body = []
    for (model, budget), mine in _groups_of(rows, ("model", "budget")).items():
        auto = next(r for r in mine if r["auto"] == "True")
        best = next(r for r in mine if r["best_measured"] == "True")
        ratio, goal = float(auto["auto_vs_best"]), float(auto["time_goal"])
        words = (
            "the best measured"
            if auto is best
            else ("within the goal" if ratio <= goal else "misses the goal")
        )
        tried = auto["trials_vs_best_tried"]
        trials = f"`{auto['trials_chose']}`: {_f(tried, 2)} of the best it tried" if tried else "-"
        body.append(
            [model, budget, _mib(float(auto["budget_bytes"])), f"`{auto['plan']}`",
             _f(auto["predicted_ms"], 1), timed_col(auto, "measured_ms", 1), f"`{best['plan']}`",
             timed_col(best, "measured_ms", 1), timed_col(auto, "auto_vs_best", 2, words), trials,
             _mib(float(auto["measured_peak_bytes"])), "yes" if auto["fits_measured"] == "True" else "**no**",
             len(mine)]
        )  # fmt: skip
    header = ["model", "budget", "MiB per device", "plan='auto' chose", "predicted milliseconds",
              "its measured ms", "best measured", "best ms", "auto / best ratio",
              "with trials=3: chose, measured / best of the tried", "its measured peak MiB (worst rank)",
              "fits", "plans run"]  # fmt: skip
    detail = [
        [r["model"], r["budget"], r["predicted_rank"], f"`{r['plan']}`", r["families"],
         _f(r["predicted_ms"], 1), timed_col(r, "measured_ms", 1), _f(r["error"], 3),
         "yes" if r["tried"] == "True" else "-", _mib(float(r["predicted_peak_bytes"])),
         _mib(float(r["measured_peak_bytes"])), _f(r["peak_error"], 3),
         *(_mib(float(r[k])) if float(r[k]) else "-" for k in HOST_COLUMNS)]
        for r in rows
    ]  # fmt: skip
    detail_header = ["model", "budget", "predicted rank", "plan", "families", "predicted milliseconds",
                     "measured ms", "error (measured / predicted - 1)", "run by trials=3",
                     "predicted peak MiB", "measured peak MiB (worst rank)", "peak error",
                     "predicted host MiB", "measured host MiB (optimizer)"]  # fmt: skip
    r0 = rows[0]
    families = [
        [f, _f(r0[f"family_{_key(f)}_median"], 2), _f(r0[f"family_{_key(f)}_worst"], 2),
         r0[f"family_{_key(f)}_plans"]]
        for f in AUTOPLAN_FAMILIES if r0.get(f"family_{_key(f)}_median")
    ]  # fmt: skip
    family_header = ["family", "median measured / predicted", "furthest from 1", "plans"]
    models = {r["model"]: r for r in rows}
    within = "; ".join(
        f"{m} {_f(r['spearman_model'], 2)} ({r['plans_model']} plans)" for m, r in models.items()
    )
    return (
        _table(header, body) + f"\n\nOver all {r0['plans_all']} plans measured: median absolute error "
        f"{_f(r0['median_abs_error'], 3)} (goal {r0['error_goal']}); Spearman rank correlation between "
        f"predicted and measured step time {_f(r0['spearman_all'], 2)} (goal {r0['spearman_goal']}); within "
        f"each model: {within}. Load average {r0['load_start']} when the runs started, {r0['load_end']} when "
        "they ended (the machine is shared). Step time: the median of each plan's timed optimizer steps over "
        "two passes (the second in reverse order), from one step's start to the next, min-max beside it; "
        "the ratio's range pairs the extremes. Peaks: MemTracker on one step, every rank; host and device "
        "are one memory here, so an offloaded optimizer's host copies, gradient buffers and state (held "
        "through the step) are taken out of the device peak and shown as the host's (activations offloaded "
        "to the host stay in the device peak); fits = the measured device peak within the budget on every "
        f"rank; the goal for the auto choice: within {r0['time_goal']} of the best measured.\n\n"
        + _table(family_header, families)
        + f"\n\nA plan is in every family of its techniques; goal: no family off by more than "
        f"{r0['family_goal']}x.\n\n" + _table(detail_header, detail)
    )


def _key(family: str) -> str:
    return family.replace(" ", "_").replace("-", "")


def _groups_of(rows: Rows, keys: tuple[str, ...]) -> dict[tuple[str, ...], Rows]:
    out: dict[tuple[str, ...], Rows] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


# ------------------------------------------------------------------------------ the questions


@dataclass(frozen=True)
class Question:
    """One section of docs/results.md: its experiment and its tables, one builder per CSV, named after it.

    The plot of a CSV, when there is one, is the PNG of the same name.
    """

    title: str
    experiment: str
    tables: tuple[Callable[[Rows], str], ...]


def gpt_pipeline(rows: Rows) -> str:
    by = {r["variant"]: r for r in rows}
    seq, traced, goal = by["sequential"], by["traced"], rows[0]["goal"]
    verdict = _verdict(traced, "ratio", goal=float(goal))
    header = [
        "path",
        "repeats",
        "samples/s",
        "step ms",
        f"traced / Sequential (goal {goal})",
        "max loss diff",
    ]
    header += ["tied-gradient sum ms", "share of the step"]
    table = [
        ["Sequential (`SequentialCharLM`)", seq["repeats"], timed_col(seq, "samples_per_s", 1),
         timed_col(seq, "step_ms", 1), "1 (baseline)", seq["max_loss_diff"], "-", "-"],
        ["traced (`CharLM`, the GPT as written)", traced["repeats"], timed_col(traced, "samples_per_s", 1),
         timed_col(traced, "step_ms", 1), timed_col(traced, "ratio", 3, verdict), traced["max_loss_diff"],
         timed_col(traced, "tied_ms", 3), timed_col(traced, "tied_share", 4)],
    ]  # fmt: skip
    return _table(header, table) + (
        "\n\nSame weights, same stage boundaries (embeddings + 2 blocks | 2 blocks + norm + tied head), "
        "interleaved in the same 2 processes; medians with (min .. max) over the repeats."
    )


def gpt_tracing(rows: Rows) -> str:
    table = [[r["seq_len"], r["repeats"], timed_col(r, "trace_s", 2)] for r in rows]
    return _table(["sequence length", "repeats", "seconds to trace forward at that shape"], table) + (
        "\n\nPaid once per run and mode: the trace has dynamic sizes, so other lengths and the short last "
        "batch use it too (see the fine-tuning benchmark)."
    )


def hf_pipeline(rows: Rows) -> str:
    by = {r["variant"]: r for r in rows}
    one, pipe = by["one_process"], by["pipeline"]
    verdict = _verdict(pipe, "ratio", words=("faster", "slower"))
    header = ["run", "repeats", "samples/s", "step ms", "pipeline / one process", "max loss diff"]
    table = [
        ["one process (`Trainer(devices=1)`, the other rank idle)", one["repeats"],
         timed_col(one, "samples_per_s", 1), timed_col(one, "step_ms", 1), "1 (baseline)", "-"],
        ["2 pipeline stages (`PipelineStrategy`, 4 micro-batches)", pipe["repeats"],
         timed_col(pipe, "samples_per_s", 1), timed_col(pipe, "step_ms", 1),
         timed_col(pipe, "ratio", 3, verdict), pipe["max_loss_diff"]],
    ]  # fmt: skip
    return _table(header, table) + (
        "\n\nA `transformers` Llama built from a config and left as is (the step calls "
        "`self.model(input_ids=x).logits`), traced and split between its middle decoder layers; "
        "interleaved with the one-process run in the same 2 processes, same seed and batches; medians "
        "with (min .. max) over the repeats, the ratio taken within each repeat. The bubble alone caps "
        f"the ratio at {pipe['ideal_ratio']} (on as many free cores as stages)."
    )


def hf_tracing(rows: Rows) -> str:
    table = [[r["seq_len"], r["repeats"], timed_col(r, "trace_s", 2)] for r in rows]
    header = ["sequence length", "repeats", "seconds to trace and split `self.model(input_ids=x)`"]
    return _table(header, table) + (
        "\n\nOn the meta twin, in one process: paid once per run and mode (the trace has dynamic sizes)."
    )


def varlen(rows: Rows) -> str:
    by = {r["variant"]: r for r in rows}
    goal = float(rows[0]["goal"])
    names = {
        "dynamic": "pipeline, each batch padded to its longest sample",
        "fixed": "pipeline, every batch padded to the longest sample (one shape)",
        "one_process": "one process (`Trainer(devices=1)`), dynamic padding",
    }
    header = [
        "run",
        "lengths",
        "traces",
        "repeats",
        "fit s",
        "vs fixed padding",
        "steps/s",
        "labelled tokens/s",
    ]
    table = []
    for name in ("dynamic", "fixed", "one_process"):
        r = by[name]
        ratio = "1 (baseline)" if name == "fixed" else timed_col(r, "ratio", 3)
        if name == "dynamic":
            ratio = timed_col(r, "ratio", 3, _verdict(r, "ratio", goal=goal, higher_is_better=False))
        table.append([names[name], r["lengths"], r["traces"], r["repeats"], timed_col(r, "fit_s", 2), ratio,
                      timed_col(r, "steps_per_s", 1), timed_col(r, "tokens_per_s", 0)])  # fmt: skip
    return _table(header, table) + (
        "\n\nOne epoch of prompt/response batches, one batch per length (prompts and padding labelled as "
        "ignored, the loss the Llama's own from `labels=`, token-exact), interleaved in the same 2 "
        "processes; the fit includes setup and tracing; medians with (min .. max) over the repeats, the "
        f"ratio taken within each repeat (goal: at most {goal})."
    )


def varlen_new_length(rows: Rows) -> str:
    table = [[r["what"], r["layers"], timed_col(r, "s", 4)] for r in rows]
    return _table(["what", "decoder layers", "seconds"], table) + (
        "\n\nA deep Llama in one process, split in two: the one trace with dynamic sizes is paid once per "
        "run and mode; each new length then costs building its stages from it (goal: under "
        f"{rows[0]['goal_s']} s), where it used to cost a whole static trace. The same depth held in a "
        "top-level Sequential: its first shapes are sized on fake tensors, and at a mode's third shape its "
        "layers are exported once with dynamic sizes (that row includes the third shape's fake run)."
    )


def hf_pretrained_memory(rows: Rows) -> str:
    header = [
        "load",
        "tensors held (MiB)",
        "peak resident memory above imports (MiB)",
        "of the whole model's",
    ]
    table = [
        [r["variant"], _f(r["held_mib"], 1), _f(r["peak_rss_mib"], 1), _f(r["peak_ratio_to_whole"], 2)]
        for r in rows
    ]
    return _table(header, table) + (
        "\n\nA 124M-parameter `transformers` Llama saved with `save_pretrained`: `from_pretrained` of the "
        "whole model, against a rank's stage built on the meta device and read with `load_pretrained` "
        "(its tensors plus the largest tensor being read). One run each, in fresh processes (bytes)."
    )


def watchdog(rows: Rows) -> str:
    by = {r["variant"]: r for r in rows}
    off, on, goal = by["off"], by["on"], float(rows[0]["goal"])
    verdict = _verdict(on, "ratio", goal=goal, higher_is_better=False)
    header = ["repeats", "step ms, no watchdog", "step ms, HangWatchdog", f"with / without (goal <= {goal})"]
    cells = [on["repeats"], timed_col(off, "step_ms", 1), timed_col(on, "step_ms", 1)]
    return _table(header, [[*cells, timed_col(on, "ratio", 3, verdict)]]) + (
        "\n\nThe main job (GPT, 2 pipeline stages); the ratio is taken within each repeat."
    )


def watchdog_calls(rows: Rows) -> str:
    by = {r["variant"]: r for r in rows}
    off, on = by["off"], by["on"]
    header = ["repeats", "all_reduce µs, untracked", "all_reduce µs, tracked", "added µs per call"]
    cells = [
        on["repeats"],
        timed_col(off, "call_us", 1),
        timed_col(on, "call_us", 1),
        timed_col(on, "added_us", 2),
    ]
    return (
        _table(header, [cells])
        + "\n\nOne number all-reduced over a one-rank gloo group (no waiting on the peer), "
        "thousands of calls per repeat."
    )


def schedules(rows: Rows) -> str:
    placement = {"1f1b": "2 stages", "interleaved_1f1b": "4, looped", "interleaved_zero_bubble": "4, looped",
                 "zbv": "4, V", "dualpipev": "4, V"}  # fmt: skip
    header = ["schedule", "stages", "repeats", "samples/s", "vs 1f1b", "schedule's ideal"]
    header += ["compute", "bubble", "comm wait", "other", "compute inflation", "activation MiB rank 0 / 1"]
    body = []
    for r in rows:
        vs = "1" if r["schedule"] == "1f1b" else timed_col(r, "vs_1f1b", 2, _verdict(r, "vs_1f1b"))
        body.append(
            [
                r["schedule"],
                placement.get(r["schedule"], "?"),
                r["repeats"],
                timed_col(r, "samples_per_s", 1),
                vs,
            ]
            + [timed_col(r, "ideal_efficiency", 3)]
            + [_f(r[k], 3) for k in ("compute", "bubble", "comm_wait", "other")]
            + [timed_col(r, "compute_inflation", 2)]
            + [f"{_f(r['activation_peak_mib_rank0'], 1)} / {_f(r['activation_peak_mib_rank1'], 1)}"]
        )
    f1b = next(r for r in rows if r["schedule"] == "1f1b")
    note = (
        f"\n\nm = {f1b['num_microbatches']}, p = {f1b['pipeline_size']}, batch {f1b['batch_size']}. The 1F1B "
        "efficiency (throughput over p x one process) is the bubble table's, above (its m = 8 row); here the "
        "schedules are compared with each other (vs 1f1b: throughput per repeat) and their steps taken "
        "apart. The next columns come from `PipelineTimeline` on two recorded steps per run (medians): "
        "shares of the ranks' step time spent computing (stage forward and backward), in the bubble the "
        "schedule itself forces (its ideal: the recorded compute replayed with free communication; "
        "schedule's ideal = compute / (compute + bubble), against the bubble-only "
        f"{_f(f1b['ideal_1f1b_bubble_efficiency'], 3)} of 1F1B with equal stages), waiting on P2P beyond "
        "that, and everything else (loss function, log broadcast, gradient sync, optimizer step, P2P posts, "
        "Python between them). Compute inflation: the ranks' stage compute per step over one process's "
        "whole step (1.0 = the layers cost the same as pipeline stages as in one process). For 1f1b the "
        "measured spans (which also hold part of the bubble: the last rank waits out the drain in the log "
        f"broadcast) are: P2P waits {_f(f1b['wait_share'], 3)}, the loss function "
        f"{_f(f1b['loss_share'], 3)}, the log broadcast and gradient sync {_f(f1b['collective_share'], 3)}, "
        f"the optimizer step {_f(f1b['optimizer_share'], 3)}, P2P posts {_f(f1b['comm_share'], 3)} and "
        f"untracked time {_f(f1b['untracked_share'], 3)}. The shares are medians over recorded steps; how "
        "to read them: [Where the time goes: PipelineTimeline](timeline.md)."
    )
    return _table(header, body) + note


def compile_bench(rows: Rows) -> str:
    body = []
    for r in rows:
        compiled = r["variant"] == "compiled"
        words = dict(goal=float(r["goal"]), higher_is_better=False)
        ratio = timed_col(r, "ratio", 2, _verdict(r, "ratio", **words)) if compiled else "1"
        compile_s = [timed_col(r, "compile_s", 1), _f(r["first_compile_s"], 1)] if compiled else ["-", "-"]
        payback = (r["break_even_steps"] or "never") if compiled else "-"
        cells = [r["workload"], r["model"], f"{r['batch']}, m={r['microbatches']}", r["variant"]]
        body.append([*cells, r["repeats"], timed_col(r, "step_ms", 1), ratio, *compile_s, payback,
                     r["max_loss_diff"] if compiled else "-"])  # fmt: skip
    header = [
        "workload",
        "model",
        "batch",
        "variant",
        "repeats",
        "step ms",
        f"vs eager ({rows[0]['goal']} goal)",
    ]
    header += ["compile s per fit (median, warm .. cold)", "first fit's compile (cold, one per job)"]
    header += ["steps to pay back the cold compile"]
    header += ["max loss diff"]
    note = (
        "\n\n`PipelineStrategy(pipeline_size=2, compile=True)` (1F1B; both models traced, each stage's "
        "program compiled whole by inductor with dynamic sizes) against the same pipeline eager, interleaved "
        "in one job. Step time: the last stage's median step after the warm-up steps, which hold the "
        "compilation; the compile time (the slower rank's) apart, per compiled fit: the job's first compiled "
        "fit starts from an empty inductor cache (cold), the later ones find its kernels and pay dynamo's "
        "tracing only. Steps to pay back: the cold compile over the time saved per step."
    )
    return _table(header, body) + note


def trace_share(rows: Rows) -> str:
    header = ["model", "ranks", "variant", "repeats", "exports, loads"]
    names = {"trace_cpu_s": "trace CPU", "setup_cpu_s": "setup CPU", "first_step_s": "first step"}
    for name in names.values():
        header += [f"{name} s" + (" per node" if "CPU" in name else ""), f"{name}: ratio to every rank"]
    body = []
    for r in rows:
        cells = [r["model"], r["ranks"], r["variant"].replace("_", " "), r["repeats"]]
        cells.append(f"{_f(r['exports'], 0)}, {_f(r['received'], 0)}")
        for key in names:
            ratio, words = f"{key}_ratio", dict(higher_is_better=False, words=("less", "more"))
            shared = r["variant"] == "shared"
            cells += [
                timed_col(r, key, 2),
                timed_col(r, ratio, 2, _verdict(r, ratio, **words)) if shared else "-",
            ]
        body.append(cells)
    return _table(header, body) + (
        "\n\nOne training step under `PipelineStrategy(pipeline_size=ranks)`, the traced forward exported by "
        "every rank (as before) or once, by rank 0, the others loading its program "
        "(`sources/traced/share.py`); "
        "interleaved in one job per rank count. Trace CPU: exporting, pickling and loading programs, summed "
        "over the ranks; setup CPU: every rank's from `fit()` to the end of the first step, summed; first "
        "step: `fit()` to the end of the first step on the slowest rank. The ratios are against every rank "
        "exporting, taken within each repeat."
    )


def trace_share_transport(rows: Rows) -> str:
    header = ["model", "repeats", "export CPU s", "GraphPickler MB", "pickle CPU s", "its load CPU s",
              "torch.export.save MB", "save CPU s", "torch.export.load CPU s"]  # fmt: skip
    body = [
        [r["model"], r["repeats"], timed_col(r, "export_cpu_s", 2), _f(r["pickle_mb"], 2),
         timed_col(r, "pickle_cpu_s", 2), timed_col(r, "unpickle_cpu_s", 2), _f(r["save_mb"], 2),
         timed_col(r, "save_cpu_s", 2), timed_col(r, "load_cpu_s", 2)]
        for r in rows
    ]  # fmt: skip
    return _table(header, body) + (
        "\n\nIn one process: the program of one export moved both ways, what a receiving rank pays against "
        "exporting it itself."
    )


def offload(rows: Rows) -> str:
    body = []
    for r in rows:
        words = {"higher_is_better": False, "words": ("faster", "slower")}
        ratio = timed_col(r, "ratio", 3, _verdict(r, "ratio", **words)) if r["variant"] != "device" else "1"
        share = timed_col(r, "host_share", 3) if r["host_copies_bytes"] else "-"
        held = ("host_copies_bytes", "host_state_bytes", "host_activations_peak_bytes")
        mib = [_f(float(r[k]) / 2**20, 2) if r[k] else "-" for k in held]
        body.append([r["variant"], r["repeats"], timed_col(r, "step_ms", 1), ratio, share, *mib])
    header = ["variant", "repeats", "step ms", "vs device", "host step's share of the step"]
    header += ["host copies + gradient buffers MiB", "host AdamW state MiB", "activations on the host MiB"]
    r0 = rows[0]
    note = (
        f"\n\n`SequentialCharLM` width {r0['model_dim']}, {r0['model_depth']} blocks, AdamW, batch "
        f"{r0['batch']} in {r0['microbatches']} micro-batches, `PipelineStrategy(pipeline_size=1)` on one "
        "process (one thread); the ratio is taken within each repeat against `device` (the user's AdamW as "
        "torch builds it on a CPU: its loop implementation). The host step's share: what `step()` spends "
        "after the closure (gradients in, the host kernel, weights out) over the step. Host and device are "
        "the same memory on this machine: the copies cost a memcpy, and nothing leaves a device; how to "
        "read it: [Offload](offload.md)."
    )
    return _table(header, body) + note


def offload_kernels(rows: Rows) -> str:
    body = []
    for r in rows:
        words = {"higher_is_better": False, "words": ("faster than fused", "slower than fused")}
        ratio = timed_col(r, "ratio", 2, _verdict(r, "ratio", **words)) if r["kernel"] != "fused" else "1"
        body.append([r["optimizer"], r["kernel"], r["repeats"], timed_col(r, "step_ms", 2), ratio])
    header = ["optimizer", "host kernel", "repeats", "ms per step", "vs fused"]
    return _table(header, body) + (
        f"\n\nOne optimizer step over the same model's {rows[0]['parameters']} parameters "
        f"({rows[0]['tensors']} tensors) on host tensors, one thread: the order offload tries the host "
        "kernels in (fused, foreach, the loop)."
    )


def offload_capacity(rows: Rows) -> str:
    def largest(p: str, offload: str, key: str) -> str:
        mine = (r for r in rows if r["pipeline_size"] == p and r["offload"] == offload)
        top = next((r for r in mine if r[f"largest_{key}"] == "True"), None)  # marked by the script
        if top is None:
            return "none"
        host = top[f"host_gib_per_node_{key}"]
        on_host = f", host {host} GiB per node" if float(host) else ""
        peak = top[f"device_peak_gib_{key}"]
        return f"{top['params_billion']} B, {top['model']} (`{top[f'plan_{key}']}`: {peak} GiB{on_host})"

    body = []
    for p in dict.fromkeys(r["pipeline_size"] for r in rows):
        dp = next(r["data_parallel"] for r in rows if r["pipeline_size"] == p)
        body.append([f"pp {p} x dp {dp}"] + [largest(p, o, k) for k in ("24", "80") for o in ("no", "yes")])
    header = ["8 devices as", "24 GiB, without offload", "24 GiB, with offload", "80 GiB, without offload",
              "80 GiB, with offload"]  # fmt: skip
    ladder = ", ".join(dict.fromkeys(f"{r['model']} ({r['params_billion']} B)" for r in rows))
    return _table(header, body) + (
        "\n\nThe largest model of the ladder that trains: some plan of that pipeline size fits the device "
        "with the planner's 10% margin (its fullest rank's predicted peak; the host bytes of the node's 8 "
        "ranks within 90% of 1 TiB), with its plan and its device peak. The planner only: each Llama shape "
        "built on the meta device and measured on fake tensors, bf16-mixed, AdamW, 4096 tokens x 16 per "
        f"optimizer step. Ladder: {ladder}. With offload: the rows that put the optimizer state and its "
        "step, or the activations in flight, on the host (the `+offload` rows of the search)."
    )


QUESTIONS = (
    Question(
        "Pipeline overhead: the Trainer against a hand-driven schedule",
        "pipeline",
        (pipeline_overhead,),
    ),
    Question("Pipeline bubble against the number of micro-batches", "pipeline", (pipeline_microbatches,)),
    Question("Pipeline schedules side by side: where the step goes (timeline)", "schedules", (schedules,)),
    Question("Memory per rank: DDP against PipelineStrategy", "pipeline_memory", (pipeline_memory,)),
    Question(
        "Memory per rank with the stages sharded: replicas, sharded optimizer state, FSDP2 (pipeline 2 x 2)",
        "fsdp_memory",
        (fsdp_memory,),
    ),
    Question(
        "Will it fit? The memory planner's prediction against MemTracker, rank by rank",
        "memory_validation",
        (memory_validation,),
    ),
    Question(
        "Metric sync: AllReducedMetrics against sync_dist=True",
        "metric_sync",
        (metric_sync, metric_sync_reduce),
    ),
    Question(
        "Checkpoints: Rank0Checkpoint against ModelCheckpoint (stall, memory, SIGKILL)",
        "checkpoint",
        (checkpoint_bench, checkpoint_kill),
    ),
    Question(
        "Distributed checkpoints under faults: a background save's stall, and SIGKILL during saves",
        "dcp_faults",
        (dcp_async, dcp_kill),
    ),
    Question(
        "Gradient accumulation: one device against several at the same global batch",
        "accumulation_equivalence",
        (accumulation_equivalence,),
    ),
    Question("Scaling the main job: one process against two", "scaling_charlm", (scaling_charlm,)),
    Question("HangWatchdog: what it costs", "watchdog", (watchdog, watchdog_calls)),
    Question(
        "Pipelining a GPT: its forward traced against its layers in a Sequential",
        "gpt_pipeline",
        (gpt_pipeline, gpt_tracing),
    ),
    Question(
        "Pipelining a Hugging Face Llama, unmodified: 2 stages against one process",
        "hf_pipeline",
        (hf_pipeline, hf_tracing),
    ),
    Question(
        "Fine-tuning data: dynamic padding against fixed padding, and what a new length costs",
        "varlen",
        (varlen, varlen_new_length),
    ),
    Question(
        "Loading a Hugging Face model's pretrained weights: the whole model against one stage per rank",
        "hf_pretrained_memory",
        (hf_pretrained_memory,),
    ),
    Question(
        "Tensor parallelism inside the stages: pp 2 x tp 2 against pp 2 x dp 2",
        "tensor_parallel",
        (tensor_parallel,),
    ),
    Question("Compiled stages: PipelineStrategy(compile=True) against eager", "compile", (compile_bench,)),
    Question(
        "Tracing once per job: one rank exports the traced forward for all, against every rank",
        "trace_share",
        (trace_share, trace_share_transport),
    ),
    Question(
        "Offload: the optimizer step and the activations on the host, and the host kernel",
        "offload",
        (offload, offload_kernels),
    ),
    Question(
        "Offload in the planner: the largest Llama that trains on a 24 GiB and an 80 GiB device",
        "offload_capacity",
        (offload_capacity,),
    ),
    Question(
        "plan='auto': the planner's choice and predicted step times against measured runs",
        "autoplan",
        (autoplan,),
    ),
)
