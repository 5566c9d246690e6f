"""Is the automatic plan right, and are its step times believable? The planner against measured runs.

For three models (the Sequential CharLM with split q, k, v projections, ``models.SequentialCharLM(
split_qkv=True)``, which FSDP2 and tensor parallelism both split; the main job's GPT ``models.CharLM``,
split by tracing; a Hugging Face Llama from a small config, ``hf_decoders.HFDecoderLM``, traced, whose
tensor-parallel stages run on DTensors) on 2 gloo ranks of this machine, each model in one job of its own
(its plans predicted and measured minutes apart, under the same load):

1. **Planned as** ``PipelineStrategy(plan="auto")`` **plans**, in the job's ranks themselves: a Trainer
   with ``plan="auto"`` (a budget everything fits, the global batch, the loader's batch of global / 2)
   and ``max_steps=0`` sets up, so the job's links are timed (each collective at several sizes), what
   every step pays is measured on a trivial stage, every rank times the units at once, the techniques
   measure FSDP2 and tensor parallelism in place and the model itself runs as replicas at two
   accumulation windows (its stages and its step as run); ``strategy.planned`` holds every plan sized
   and timed.
2. Two device budgets per model, artificial on this CPU machine and chosen from the predicted peaks: one
   where data parallelism fits (every plan fits), one where it does not (below the smallest peak of any
   ``pipeline_size=1`` plan, less the 10% margin). For each budget its **top six predicted plans that fit**
   run for real; so does the fastest predicted plan of each **family** (replicas, ZeRO-1, FSDP2, tensor
   parallel, offload, interleaved, pipeline) where the model has one, so every family is measured.
3. Each run is ``PipelineStrategy.from_plan(plan)`` under the Trainer, the loader's batch and the
   accumulation as ``plan="auto"`` would run them: two warm-up steps, one step measured by ``MemTracker``
   (every rank's peak, as ``memory_validation.py`` measures it; host and device being one memory here, an
   offloaded optimizer's host copies and state, held through the step, are taken out of it as the host's
   share), then timed optimizer steps, from one step's start to the next (what a user sees: the data,
   Lightning's loop, the step; no barrier). The sequence of plans runs twice, the second time in reverse
   order, and each plan's step time is the median of its timed steps over both passes (min-max beside it).
4. **With trials**: after the runs, for each budget, ``plan="auto", trials=3`` in the same ranks
   (``max_steps=0``): the plan its trials keep, and their measured steps beside the predictions.

Reported (``autoplan.csv``, one row per model x budget x plan; ``autoplan.png``, predicted against
measured step time): per plan the predicted and the measured step and the error (measured / predicted
- 1), its families; the auto choice (the fastest predicted that fits) against the best measured, and the
trials' choice against the best measured among the plans it tried; the Spearman rank correlation of
predicted and measured step times over all measured plans and within each model; per family the median
and the worst measured / predicted; the load average when the runs started and ended (the machine is
shared). Goals (issue 55): median absolute error <= 20%, no family off by more than 1.5x, Spearman >= 0.9,
the auto choice within 1.05x of the best measured.

Usage::

    python experiments/bench_autoplan.py            # ~7 minutes on 2 cores
    python experiments/bench_autoplan.py --quick    # one model, one budget, its first two plans, once each,
                                                    # a step of each kind; trials=2 (a smoke run)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import _harness as h
import _tables as t
import torch
import torch.distributed as dist
from _meters import StepMeter
from models import CharLM, SequentialCharLM
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import PipelineStrategy
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.ranking import Budget
from lightning_parallel.strategies.pipeline import autoplan as planning  # (`autoplan`: the table below)
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping

MODELS = ("Sequential CharLM (split qkv)", "GPT (traced)", "HF Llama")
DIM, DEPTH, SEQ_LEN, GLOBAL_BATCH, DEVICES = 128, 4, 64, 16, 2
LOADER_BATCH = GLOBAL_BATCH // DEVICES  # one replica's batch, as a user's loader yields it
WARMUP, TRACKED, TIMED = 2, 1, 6  # optimizer steps: warm-up, the one MemTracker measures, the timed ones
TOP, TRIALS = 6, 3
# --quick: a smoke run of every phase, its numbers unread: each run's steps one of each kind, the
# measurements of plan="auto" one step (no warm-up) and two link sizes, trials=2 (the fewest that run).
QUICK_STEPS, QUICK_TRIALS = (1, 1, 1), 2
FAMILIES = ("replicas", "ZeRO-1", "FSDP2", "tensor parallel", "offload", "interleaved", "pipeline")
GOALS = {"error_goal": 0.20, "family_goal": 1.5, "spearman_goal": 0.9, "time_goal": 1.05}
QUICK = planning.Measurement(link_sizes=(1 << 10, 1 << 16), link_repeats=1, repeats=1,
                             overhead_steps=(0, 1), trial_steps=(0, 1))  # fmt: skip


def build(model: str) -> Any:
    torch.manual_seed(0)
    if model.startswith("Sequential CharLM"):
        return SequentialCharLM(dim=DIM, depth=DEPTH, seq_len=SEQ_LEN, split_qkv=True)
    if model == "GPT (traced)":
        return CharLM(dim=DIM, depth=DEPTH, seq_len=SEQ_LEN)
    from hf_decoders import HFDecoderLM

    return HFDecoderLM("llama", dim=DIM, depth=DEPTH, seq_len=SEQ_LEN)


def batch(samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (samples, SEQ_LEN + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loader(steps: int, seed: int = 1) -> DataLoader:
    x, y = batch(GLOBAL_BATCH * steps, seed)
    return DataLoader(TensorDataset(x, y), batch_size=LOADER_BATCH)


def families(plan: ParallelPlan) -> list[str]:
    """The families a plan belongs to (a plan with several techniques is in each of theirs)."""
    out = []
    if plan.tensor_parallel_size > 1:
        out.append("tensor parallel")
    out += {"fsdp": ["FSDP2"], "zero1": ["ZeRO-1"]}.get(plan.data_parallel, [])
    if plan.offload:
        out.append("offload")
    if plan.schedule == "interleaved_1f1b":
        out.append("interleaved")
    elif plan.pipeline_size > 1:
        out.append("pipeline")
    if (
        plan.pipeline_size == 1
        and plan.tensor_parallel_size == 1
        and plan.data_parallel == "replicate"
        and (not plan.offload)
    ):
        out.append("replicas")
    return out


# ------------------------------------------------------------------------------------------ planning


def plan_worker(rank: int, world: int, model: str, quick: bool, budgets: dict[str, int] | None) -> Any:
    """``plan="auto"`` sets up (``max_steps=0``): with ``budgets``, once per budget with trials, the plans
    its trials kept and their measurements; else once, every plan it sized and timed (rank 0's)."""
    h.quiet()
    if quick:
        planning.MEASURE = QUICK
    if budgets is None:
        return _planned(world, model, "4GiB", None)
    trials = QUICK_TRIALS if quick else TRIALS
    return {name: _planned(world, model, device, trials) for name, device in budgets.items()}


def _planned(world: int, model: str, memory: Any, trials: int | None) -> Any:
    strategy = PipelineStrategy(plan="auto", memory=memory, global_batch_size=GLOBAL_BATCH, trials=trials)
    trainer = h.quiet_trainer(devices=world, strategy=strategy, max_steps=0)
    trainer.fit(build(model), loader(1))
    planned = trainer.strategy.planned
    if planned is None:  # (rank 1)
        return None
    if trials:
        trials = [(t.plan.label(), t.predicted, t.measured, t.error) for t in planned.trials]
        return {"chosen": trainer.strategy.parallel_plan.label(), "trials": trials}
    rows = [
        dict(plan=c.plan, label=c.plan.label(), predicted_s=c.seconds, peak=c.peak,
             host=max(r.host for r in c.estimate.ranks), accumulate=c.accumulate, samples=c.samples,
             bubble=c.time.bubble, communication_s=c.time.communication, overhead_s=c.time.overhead)
        for c in planned.candidates
    ]  # fmt: skip
    return {"candidates": rows, "links": planned.links.describe(), "notes": planned.notes}


def budgets_for(candidates: list[dict[str, Any]]) -> dict[str, Budget]:
    """Data parallelism fits (every plan fits), and it does not (below every pipeline_size=1 plan)."""
    everything = max(c["peak"] for c in candidates)
    whole = [c for c in candidates if c["plan"].pipeline_size == 1 and c["plan"].tensor_parallel_size == 1]
    dp = min(c["peak"] for c in whole)
    mib = 2**20
    return {
        "data parallel fits": Budget(-(-int(everything / 0.9) // mib) * mib),
        "data parallel does not fit": Budget(int(dp * 0.97 / 0.9) // (mib // 16) * (mib // 16)),
    }


def fits(c: dict[str, Any], budget: Budget) -> bool:
    return c["peak"] <= budget.usable


def picks_for(candidates: list[dict[str, Any]], budget: Budget, quick: bool) -> list[dict[str, Any]]:
    """The top predicted plans that fit (the first is plan="auto"'s choice), then the fastest predicted of
    each family not among them."""
    fitting = [c for c in candidates if fits(c, budget)]
    top = fitting[: 2 if quick else TOP]
    if quick:
        return top
    for family in FAMILIES:
        if not any(family in families(c["plan"]) for c in top):
            first = next((c for c in fitting if family in families(c["plan"])), None)
            if first is not None:
                top.append(first)
    return top


# ------------------------------------------------------------------------------------------ measuring


def model_worker(rank: int, world: int, model: str, quick: bool) -> dict[str, Any]:
    """One model in one job, so that its plans are predicted and measured under the same load: planned as
    ``plan="auto"`` plans (rank 0's plans handed to every rank), the budgets and the plans to run, each
    run twice (the second pass reversed), then ``plan="auto", trials=3`` per budget."""
    load = os.getloadavg()[0]
    box = [plan_worker(rank, world, model, quick, None)]
    dist.broadcast_object_list(box, src=0)
    found = box[0]
    budgets = budgets_for(found["candidates"])
    if quick:  # the first budget only
        budgets = dict(list(budgets.items())[:1])
    picks = {name: picks_for(found["candidates"], b, quick) for name, b in budgets.items()}
    plans = {c["label"]: c for mine in picks.values() for c in mine}
    steps = QUICK_STEPS if quick else (WARMUP, TRACKED, TIMED)
    jobs = [{"key": f"{model}|{label}", "model": model, "plan": c["plan"], "accumulate": c["accumulate"],
             "steps": steps} for label, c in plans.items()]  # fmt: skip
    runs = []
    for pass_, order in enumerate((jobs, list(reversed(jobs)))[: 1 if quick else 2]):
        for job in order:
            runs.append(one_run(rank, world, job) | {"pass": pass_})
    tried = plan_worker(rank, world, model, quick, {name: b.device for name, b in budgets.items()})
    return dict(found=found, budgets=budgets, picks=picks, runs=runs, tried=tried, load=load,
                load_end=os.getloadavg()[0])  # fmt: skip


def one_run(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    plan: ParallelPlan = job["plan"]
    accumulate = job["accumulate"]
    warmup, tracked, timed = job["steps"]
    clock, meter = h.StepClock(), StepMeter(step=warmup * accumulate)
    steps = warmup + tracked + timed
    trainer = h.quiet_trainer(devices=world, strategy=PipelineStrategy.from_plan(plan), max_steps=steps,
                              accumulate_grad_batches=accumulate, callbacks=[meter, clock])  # fmt: skip
    # Every replica reads its own batches (Lightning's sampler): the global batch is GLOBAL_BATCH.
    trainer.fit(build(job["model"]), loader(steps))
    # Host and device are one memory here: MemTracker's peak holds an offloaded optimizer's host copies,
    # gradient buffers and state too, all held through the step; the device's share is the rest.
    # (Activations offloaded to the host stay in the device's share: their copies come and go.)
    optimizer = getattr(trainer.optimizers[0], "optim", trainer.optimizers[0])
    host = sum(optimizer.host_bytes().values()) if is_host_stepping(optimizer) else 0
    return {"key": job["key"], "rank": rank, "peak": meter.peak - host, "host": host,
            "times": step_seconds(clock, accumulate, warmup + tracked)}  # fmt: skip


def step_seconds(clock: h.StepClock, accumulate: int, skip: int) -> list[float]:
    """Each optimizer step's seconds, from its first batch's start to the next step's (the last: to its
    end), after ``skip`` steps: what a user measures, the data, Lightning's loop and the step."""
    starts = [*clock.starts[::accumulate], clock.ends[-1]]
    return [b - a for a, b in zip(starts[skip:], starts[skip + 1 :])]


# ------------------------------------------------------------------------------------------ results


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def rows_for(
    model: str, budget_name: str, budget: Budget, picks: list[dict[str, Any]], measured: dict[str, Any],
    tried: dict[str, Any] | None,
) -> list[dict[str, Any]]:  # fmt: skip
    fitting_rank = {c["label"]: i + 1 for i, c in enumerate(picks)}
    out = []
    for c in picks:
        m = measured[f"{model}|{c['label']}"]
        out.append(
            dict(model=model, budget=budget_name, budget_bytes=budget.device, usable_bytes=budget.usable,
                 predicted_rank=fitting_rank[c["label"]], auto=c is picks[0], plan=c["label"],
                 code=c["plan"].code(), families=", ".join(families(c["plan"])),
                 predicted_ms=round(c["predicted_s"] * 1e3, 2), measured_ms=m["ms"],
                 measured_ms_min=m["ms_min"], measured_ms_max=m["ms_max"], steps_timed=m["steps"],
                 error=round(m["ms"] / (c["predicted_s"] * 1e3) - 1, 4),
                 overhead_ms=round(c["overhead_s"] * 1e3, 2), predicted_peak_bytes=c["peak"],
                 measured_peak_bytes=m["peak"], peak_error=round(c["peak"] / m["peak"] - 1, 4),
                 predicted_host_bytes=c["host"], measured_host_bytes=m["host"],
                 fits_measured=m["peak"] <= budget.device, bubble=round(c["bubble"], 4),
                 communication_ms=round(c["communication_s"] * 1e3, 2))
        )  # fmt: skip
    best = min(out, key=lambda r: r["measured_ms"])
    auto = out[0]
    tried_labels = [t[0] for t in tried["trials"]] if tried else []
    among = [r for r in out if r["plan"] in tried_labels]
    trial_best = min(among, key=lambda r: r["measured_ms"]) if among else None
    trial_choice = next((r for r in out if tried and r["plan"] == tried["chosen"]), None)
    for r in out:
        r["best_measured"] = r is best
        r["auto_vs_best"] = round(auto["measured_ms"] / best["measured_ms"], 4)
        r["auto_vs_best_min"] = round(auto["measured_ms_min"] / best["measured_ms_max"], 4)
        r["auto_vs_best_max"] = round(auto["measured_ms_max"] / best["measured_ms_min"], 4)
        r["tried"] = r["plan"] in tried_labels
        r["trials_chose"] = tried["chosen"] if tried else ""
        found = trial_choice is not None and trial_best is not None
        ratio = trial_choice["measured_ms"] / trial_best["measured_ms"] if found else None
        r["trials_vs_best_tried"] = round(ratio, 4) if ratio is not None else ""
        trial = next((t for t in (tried or {}).get("trials", []) if t[0] == r["plan"]), None)
        r["trial_ms"] = round(trial[2] * 1e3, 2) if trial and trial[2] is not None else ""
    return out


def with_summary(rows: list[dict[str, Any]], load_start: float, load_end: float) -> dict[str, Any]:
    """Spearman over all measured plans (each model's plan once) and within each model; the median
    absolute error; each family's median and worst measured / predicted; into every row."""
    unique = {(r["model"], r["plan"]): r for r in rows}
    every = spearman([r["predicted_ms"] for r in unique.values()],
                     [r["measured_ms"] for r in unique.values()])  # fmt: skip
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for (m, _), r in unique.items() if m == model]
        within = spearman([r["predicted_ms"] for r in mine], [r["measured_ms"] for r in mine])
        for r in rows:
            if r["model"] == model:
                r["spearman_model"] = round(within, 4)
                r["plans_model"] = len(mine)
    summary: dict[str, Any] = {
        "spearman_all": round(every, 4),
        "plans_all": len(unique),
        "median_abs_error": round(statistics.median(abs(r["error"]) for r in unique.values()), 4),
        "load_start": round(load_start, 2),
        "load_end": round(load_end, 2),
    }
    for family in FAMILIES:
        ratios = [1 + r["error"] for r in unique.values() if family in r["families"].split(", ")]
        key = family.replace(" ", "_").replace("-", "")
        summary[f"family_{key}_median"] = round(statistics.median(ratios), 3) if ratios else ""
        summary[f"family_{key}_worst"] = round(max(ratios, key=lambda x: abs(x - 1)), 3) if ratios else ""
        summary[f"family_{key}_plans"] = len(ratios)
    for r in rows:
        r.update(summary)
        r.update(GOALS)
    return summary


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    fig, ax = h.figure(size=(7.5, 6.5))
    unique = {(r["model"], r["plan"]): r for r in rows}
    autos = {(r["model"], r["plan"]) for r in rows if r["auto"] in (True, "True")}
    colours = ("tab:blue", "tab:orange", "tab:green")
    for colour, model in zip(colours, dict.fromkeys(r["model"] for r in rows)):
        mine = [(k, r) for k, r in unique.items() if k[0] == model]
        xs = [r["measured_ms"] for _, r in mine]
        ys = [r["predicted_ms"] for _, r in mine]
        lo = [r["measured_ms"] - r["measured_ms_min"] for _, r in mine]
        hi = [r["measured_ms_max"] - r["measured_ms"] for _, r in mine]
        ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", color=colour, alpha=0.8, capsize=2, label=model)
        chosen = [(r["measured_ms"], r["predicted_ms"]) for k, r in mine if k in autos]
        ax.scatter([c[0] for c in chosen], [c[1] for c in chosen], s=160, facecolors="none",
                   edgecolors=colour, linewidths=1.5)  # fmt: skip
    values = [v for r in unique.values() for v in (r["measured_ms"], r["predicted_ms"])]
    line = [min(values) * 0.8, max(values) * 1.2]
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    for f in (0.8, 1.2):
        ax.plot(line, [v * f for v in line], color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms, median; min-max over the timed steps)",
           ylabel="predicted step (ms)", title="Step time per plan: the planner against the Trainer "
           "(circled: plan='auto''s choice; dashed: 20%)")  # fmt: skip
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md

HOST_COLUMNS = ("predicted_host_bytes", "measured_host_bytes")
AUTOPLAN_FAMILIES = ("replicas", "ZeRO-1", "FSDP2", "tensor parallel", "offload", "interleaved", "pipeline")


def autoplan(rows: t.Rows) -> str:
    body = []
    for (model, budget), mine in t.groups_of(rows, ("model", "budget")).items():
        auto = next(r for r in mine if r["auto"] == "True")
        best = next(r for r in mine if r["best_measured"] == "True")
        ratio, goal = float(auto["auto_vs_best"]), float(auto["time_goal"])
        words = (
            "the best measured"
            if auto is best
            else ("within the goal" if ratio <= goal else "misses the goal")
        )
        tried = auto["trials_vs_best_tried"]
        trials = f"`{auto['trials_chose']}`: {t.fixed(tried, 2)} of the best it tried" if tried else "-"
        body.append(
            [model, budget, t.mib(float(auto["budget_bytes"])), f"`{auto['plan']}`",
             t.fixed(auto["predicted_ms"], 1), t.timed_col(auto, "measured_ms", 1), f"`{best['plan']}`",
             t.timed_col(best, "measured_ms", 1), t.timed_col(auto, "auto_vs_best", 2, words), trials,
             t.mib(float(auto["measured_peak_bytes"])),
             "yes" if auto["fits_measured"] == "True" else "**no**", len(mine)]
        )  # fmt: skip
    header = ["model", "budget", "MiB per device", "plan='auto' chose", "predicted milliseconds",
              "its measured ms", "best measured", "best ms", "auto / best ratio",
              "with trials=3: chose, measured / best of the tried", "its measured peak MiB (worst rank)",
              "fits", "plans run"]  # fmt: skip
    detail = [
        [r["model"], r["budget"], r["predicted_rank"], f"`{r['plan']}`", r["families"],
         t.fixed(r["predicted_ms"], 1), t.timed_col(r, "measured_ms", 1), t.fixed(r["error"], 3),
         "yes" if r["tried"] == "True" else "-", t.mib(float(r["predicted_peak_bytes"])),
         t.mib(float(r["measured_peak_bytes"])), t.fixed(r["peak_error"], 3),
         *(t.mib(float(r[k])) if float(r[k]) else "-" for k in HOST_COLUMNS)]
        for r in rows
    ]  # fmt: skip
    detail_header = ["model", "budget", "predicted rank", "plan", "families", "predicted milliseconds",
                     "measured ms", "error (measured / predicted - 1)", "run by trials=3",
                     "predicted peak MiB", "measured peak MiB (worst rank)", "peak error",
                     "predicted host MiB", "measured host MiB (optimizer)"]  # fmt: skip
    r0 = rows[0]
    families = [
        [f, t.fixed(r0[f"family_{_key(f)}_median"], 2), t.fixed(r0[f"family_{_key(f)}_worst"], 2),
         r0[f"family_{_key(f)}_plans"]]
        for f in AUTOPLAN_FAMILIES if r0.get(f"family_{_key(f)}_median")
    ]  # fmt: skip
    family_header = ["family", "median measured / predicted", "furthest from 1", "plans"]
    models = {r["model"]: r for r in rows}
    within = "; ".join(
        f"{m} {t.fixed(r['spearman_model'], 2)} ({r['plans_model']} plans)" for m, r in models.items()
    )
    return (
        t.table(header, body) + f"\n\nOver all {r0['plans_all']} plans measured: median absolute error "
        f"{t.fixed(r0['median_abs_error'], 3)} (goal {r0['error_goal']}); Spearman rank correlation "
        f"between predicted and measured step time {t.fixed(r0['spearman_all'], 2)} (goal "
        f"{r0['spearman_goal']}); within "
        f"each model: {within}. Load average {r0['load_start']} when the runs started, {r0['load_end']} when "
        "they ended (the machine is shared). Step time: the median of each plan's timed optimizer steps over "
        "two passes (the second in reverse order), from one step's start to the next, min-max beside it; "
        "the ratio's range pairs the extremes. Peaks: MemTracker on one step, every rank; host and device "
        "are one memory here, so an offloaded optimizer's host copies, gradient buffers and state (held "
        "through the step) are taken out of the device peak and shown as the host's (activations offloaded "
        "to the host stay in the device peak); fits = the measured device peak within the budget on every "
        f"rank; the goal for the auto choice: within {r0['time_goal']} of the best measured.\n\n"
        + t.table(family_header, families)
        + f"\n\nA plan is in every family of its techniques; goal: no family off by more than "
        f"{r0['family_goal']}x.\n\n" + t.table(detail_header, detail)
    )


def _key(family: str) -> str:
    return family.replace(" ", "_").replace("-", "")


RESULTS = t.Results(
    "autoplan",
    t.Section(
        "plan='auto': the planner's choice and predicted step times against measured runs",
        t.Table(
            autoplan,
            (
                "predicted_ms",
                "measured_ms",
                "measured_ms_max",
                "measured_peak_bytes",
                "spearman_all",
                "median_abs_error",
            ),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> int:
    args = h.parser(__doc__, repeats=None).parse_args(argv)
    h.record_machine("autoplan", args.out_dir)
    h.quiet()
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    models = MODELS[:1] if args.quick else MODELS
    rows = []
    for model in models:
        per_rank = h.spawn(model_worker, DEVICES, model, args.quick)
        done = per_rank[0]
        loads = f"load average {done['load']:.1f} -> {done['load_end']:.1f}"
        print(f"{model} ({loads}): {done['found']['links']}", flush=True)
        print(f"  {model}, what plan='auto' noted: {'; '.join(done['found']['notes'])}", flush=True)
        measured = {}
        for c in {c["label"]: c for mine in done["picks"].values() for c in mine}.values():
            key = f"{model}|{c['label']}"
            mine = [r for records in per_rank for r in records["runs"] if r["key"] == key]
            s = h.spread(t * 1e3 for r in mine if r["rank"] == 0 for t in r["times"])
            measured[key] = dict(ms=round(s.median, 2), ms_min=round(s.lo, 2), ms_max=round(s.hi, 2),
                                 steps=s.n, peak=max(r["peak"] for r in mine),
                                 host=max(r["host"] for r in mine))  # fmt: skip
        for name, mine in done["picks"].items():
            if mine:
                rows += rows_for(model, name, done["budgets"][name], mine, measured, done["tried"].get(name))
    load_end = os.getloadavg()[0]
    summary = with_summary(rows, load_start, load_end)
    h.write_csv(args.out_dir / "autoplan.csv", rows)
    plot(args.out_dir / "autoplan.png", rows)
    for r in rows:
        print(f"{r['model']:<28} {r['budget']:<26} {r['plan']:<38} predicted {r['predicted_ms']:7.1f} ms, "
              f"measured {r['measured_ms']:7.1f} ms ({r['error']:+.0%}){'  <- auto' if r['auto'] else ''}"
              f"{'  <- trials' if r['plan'] == r['trials_chose'] else ''}")  # fmt: skip
    print(f"over {summary['plans_all']} plans: median |error| {summary['median_abs_error']:.1%}, Spearman "
          f"{summary['spearman_all']:.3f}; load average {load_start:.1f} -> {load_end:.1f}; done in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    for family in FAMILIES:
        key = family.replace(" ", "_").replace("-", "")
        print(f"  {family}: median measured / predicted {summary[f'family_{key}_median']}, worst "
              f"{summary[f'family_{key}_worst']} ({summary[f'family_{key}_plans']} plans)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
