"""Compiled stages against eager ones: ``PipelineStrategy(compile=True)`` on 2 CPU processes.

Two models, each trained by the same 2-stage pipeline (1F1B) twice per repeat, eager and compiled,
interleaved inside ONE spawned job (eager first, then compiled first, ...); same seed, same batches:

* **llama**: a Hugging Face Llama (``hf_decoders.HFDecoderLM``: RMSNorm, rotary embeddings, SwiGLU,
  grouped-query attention), 8 decoder layers of width 64 on 16 x 128 bytes in 4 micro-batches: the
  blocks' compute is nearly the whole step (the embedding and the 256-way head are small);
* **demo**: the main job's model and settings (``make demo``: ``CharLM`` width 64, one block per stage,
  8 x 128 bytes in 2 micro-batches), to say whether compiling pays there.

Both are split by tracing their forward (the traced path), so ``compile=True`` compiles each stage's
program whole, with dynamic sizes (torch.compile's inductor on the CPU, one compile thread).

Reported, per model: the median step time after the warm-up steps (rank 1's clock, the last stage;
the compilation runs in the first step, which the warm-up leaves out) and the per-repeat ratio
compiled / eager with its range (goal <= 0.8); the compile time apart (``strategy.compile_seconds``,
the slower rank's, per compiled fit: the first of the job compiles from an empty inductor cache, the
later ones find its kernels and pay dynamo's tracing only); the largest loss difference between the
two (float rounding only); and the break-even: how many steps the time saved per step takes to pay for
the first (cold) compilation.

Writes ``compile_bench.csv`` and ``compile_bench.png``.

Usage::

    python experiments/bench_compile.py            # a few minutes on 2 cores
    python experiments/bench_compile.py --quick    # a smoke run: the demo model, aot_eager, 2 steps
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import _harness as h
import _tables as t
import torch
from hf_decoders import HFDecoderLM
from models import ByteWindows, CharLM
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import PipelineStrategy

GOAL = 0.8  # compiled steps at most this share of the eager steps' time (issue 33)
BASELINE, VARIANTS = "eager", ("eager", "compiled")
COMPILE = {"options": {"compile_threads": 1}}  # on 2 busy cores a pool of compile workers only adds cost
WORKLOADS = {  # name -> model and batch
    "llama": dict(family="llama", dim=64, depth=8, seq_len=128, batch_size=16, microbatches=4),
    "demo": dict(family="charlm", dim=64, depth=2, seq_len=128, batch_size=8, microbatches=2),
}


def build(w: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    if w["family"] == "charlm":
        return CharLM(dim=w["dim"], depth=w["depth"], seq_len=w["seq_len"], lr=1e-2)
    return HFDecoderLM(w["family"], dim=w["dim"], depth=w["depth"], seq_len=w["seq_len"])


def loader(w: dict[str, Any], steps: int) -> DataLoader:
    data = ByteWindows.of_stdlib((steps + 2) * w["batch_size"], w["seq_len"])
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=w["batch_size"], sampler=sampler, drop_last=True)


def timed_fit(w: dict[str, Any], compiled: bool, args: dict[str, Any]) -> dict[str, Any]:
    """One fit of warm-up + timed steps; this rank's step times, losses and compile seconds."""
    clock = h.StepClock()
    strategy = PipelineStrategy(
        pipeline_size=2, num_microbatches=w["microbatches"], compile=args["compile"] if compiled else False
    )
    steps = args["warmup"] + args["steps"]
    trainer = h.quiet_trainer(devices=2, strategy=strategy, max_steps=steps, limit_val_batches=0,
                              callbacks=[clock])  # fmt: skip
    trainer.fit(build(w), train_dataloaders=loader(w, steps))
    return dict(
        step_ms=clock.median_step_ms(args["warmup"]),
        compile_s=strategy.compile_seconds,
        losses=clock.losses,
    )


def worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """On every rank: per workload, eager and compiled interleaved; this rank's samples."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args["cache_dir"]  # empty at the start of the job
    torch.set_num_threads(1)
    samples = []
    for name in args["workloads"]:
        w = WORKLOADS[name] | args["sizes"].get(name, {})
        variants = {v: (lambda v=v, w=w: timed_fit(w, v == "compiled", args)) for v in VARIANTS}
        samples += [dict(s, workload=name) for s in h.interleave(variants, args["repeats"], h.barrier)]
    return samples


def rows_of(args: dict[str, Any], ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (workload, variant): step time and ratio with ranges (rank 1's clock), compile time."""
    rows = []
    for name in args["workloads"]:
        w = WORKLOADS[name] | args["sizes"].get(name, {})
        at = [i for i, s in enumerate(ranks[-1]) if s["workload"] == name]
        mine = [ranks[-1][i] for i in at]
        # the slower rank's compile time, per compiled fit in the job's order (the first one is cold)
        compiles = [
            max(r[i]["compile_s"] for r in ranks) for i in at if ranks[-1][i]["variant"] == "compiled"
        ]
        diffs = []
        for rep in range(args["repeats"]):
            pair = {s["variant"]: s["losses"] for s in mine if s["repeat"] == rep}
            diffs += [abs(a - b) for a, b in zip(pair["eager"], pair["compiled"])]
        compared = {r["variant"]: r for r in h.compare(mine, "step_ms", baseline=BASELINE)}
        saved_ms = compared["eager"]["step_ms"] - compared["compiled"]["step_ms"]
        for variant, row in compared.items():
            compiled = variant == "compiled"
            rows.append(
                row
                | dict(
                    workload=name,
                    model=f"{w['family']} width {w['dim']}, {w['depth']} blocks",
                    batch=f"{w['batch_size']}x{w['seq_len']}",
                    microbatches=w["microbatches"],
                    first_compile_s=round(compiles[0], 2) if compiled else 0.0,
                    **h.spread(compiles if compiled else [0.0]).cells("compile_s", 2),
                    break_even_steps=round(1e3 * compiles[0] / saved_ms) if compiled and saved_ms > 0 else "",
                    max_loss_diff=f"{max(diffs):.2e}",
                    goal=GOAL,
                )
            )
    return rows


COLUMNS = [
    "workload", "model", "batch", "microbatches", "variant", "repeats", "step_ms", "step_ms_min",
    "step_ms_max", "ratio", "ratio_min", "ratio_max", "first_compile_s", "compile_s", "compile_s_min",
    "compile_s_max", "break_even_steps", "max_loss_diff", "goal",
]  # fmt: skip


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    fig, (left, right) = h.figure(2)
    names = list(dict.fromkeys(r["workload"] for r in rows))
    for i, variant in enumerate(VARIANTS):
        sel = [next(r for r in rows if r["workload"] == n and r["variant"] == variant) for n in names]
        xs = [k + 0.35 * (i - 0.5) for k in range(len(names))]
        h.errorbars(left, xs, sel, "step_ms", fmt="o", label=variant)
    left.set_xticks(range(len(names)), names)
    left.set(ylabel="step time (ms), median and range", title="Step time, compile time apart")
    compiled = [next(r for r in rows if r["workload"] == n and r["variant"] == "compiled") for n in names]
    h.errorbars(right, range(len(names)), compiled, "ratio", fmt="s", label="compiled / eager")
    right.axhline(1.0, color="k", lw=0.8)
    right.axhline(GOAL, color="g", ls="--", label=f"goal {GOAL}")
    right.set_xticks(range(len(names)), names)
    right.set(ylabel="compiled / eager step time (per repeat)", title="Compiled against eager")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("PipelineStrategy(compile=True), 2 CPU processes, 1F1B; interleaved repeats", fontsize=9)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def compile_bench(rows: t.Rows) -> str:
    body = []
    for r in rows:
        compiled = r["variant"] == "compiled"
        words = dict(goal=float(r["goal"]), higher_is_better=False)
        ratio = t.timed_col(r, "ratio", 2, t.ratio_verdict(r, "ratio", **words)) if compiled else "1"
        compile_s = (
            [t.timed_col(r, "compile_s", 1), t.fixed(r["first_compile_s"], 1)] if compiled else ["-", "-"]
        )
        payback = (r["break_even_steps"] or "never") if compiled else "-"
        cells = [r["workload"], r["model"], f"{r['batch']}, m={r['microbatches']}", r["variant"]]
        body.append([*cells, r["repeats"], t.timed_col(r, "step_ms", 1), ratio, *compile_s, payback,
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
    return t.table(header, body) + note


RESULTS = t.Results(
    "compile",
    t.Section(
        "Compiled stages: PipelineStrategy(compile=True) against eager",
        t.Table(
            compile_bench,
            ("step_ms", "step_ms_min", "ratio", "ratio_max", "compile_s", "compile_s_max", "first_compile_s"),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument(
        "--steps", type=int, default=10, help="timed steps per fit, after the warm-up (default 10)"
    )
    p.add_argument("--only", choices=list(WORKLOADS), help="one workload only")
    args = p.parse_args(argv)
    h.record_machine("compile", args.out_dir)
    sizes: dict[str, dict[str, Any]] = {}
    workloads = [args.only] if args.only else list(WORKLOADS)
    compile_options: dict[str, Any] = COMPILE
    if args.quick:
        # the same code path without inductor's C++ builds (a minute of CPU): it checks that it runs
        sizes = {"llama": dict(depth=2, seq_len=32, batch_size=8), "demo": dict(seq_len=32)}
        workloads, compile_options = [args.only or "demo"], {"backend": "aot_eager"}
    config = dict(
        repeats=1 if args.quick else args.repeats,
        steps=1 if args.quick else args.steps,
        warmup=1 if args.quick else 2,
        workloads=workloads,
        sizes=sizes,
        compile=compile_options,
    )
    print(f"config: {config}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lp-inductor-") as cache_dir:
        ranks = h.spawn(worker, 2, config | {"cache_dir": cache_dir})
    rows = rows_of(config, ranks)
    h.write_csv(args.out_dir / "compile_bench.csv", rows, COLUMNS)
    plot(args.out_dir / "compile_bench.png", rows)
    for r in rows:
        if r["variant"] == "compiled":
            verdict = h.verdict(r["ratio_min"], r["ratio_max"], goal=GOAL, higher_is_better=False)
            steps = r["break_even_steps"]
            pays = f"pays for itself after {steps} steps" if steps else "never pays (no faster step)"
            print(
                f"{r['workload']}: compiled / eager {r['ratio']:.3f} ({r['ratio_min']:.3f} .. "
                f"{r['ratio_max']:.3f}), goal <= {GOAL}: {verdict}; first compile {r['first_compile_s']} s, "
                f"{pays}"
            )
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
