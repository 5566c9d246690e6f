"""One export of the traced forward per job against one per rank: trace CPU and the time to the first step.

Two models split by tracing: the Hugging Face Llama of ``bench_hf_pipeline.py`` (``HFDecoderLM("llama",
dim=128, depth=8, seq_len=64)``, its step calling ``self.model(input_ids=x).logits``) and ``make demo``'s
GPT (``models.CharLM``, width 128, 4 blocks, its ``forward`` traced). Each trains one step under
``PipelineStrategy(pipeline_size=ranks, num_microbatches=4)`` (1F1B), at 2 and then 4 ranks (on 2 cores:
4 ranks share them), two variants interleaved in one spawned job per rank count:

* **every_rank** (the baseline, as before sharing): ``LIGHTNING_PARALLEL_SHARE_TRACES=0``, every rank
  exports the program (the fingerprints are still compared);
* **shared**: global rank 0 exports, the others load its program (``sources/traced/share.py``).

Reported per fit (the model is built before the clock starts):

* **trace CPU per node**: CPU seconds spent exporting, pickling and loading programs, summed over the
  ranks (``traced.share.tally``); the rest of the trace (cutting the stages, sizing them) is the same
  in both and is in the next number;
* **setup CPU per node**: CPU seconds from ``fit()`` to the end of the first step, summed over the ranks;
* **time to the first step**: seconds from ``fit()`` to the end of the first step on the slowest rank.

And in one process, what the program costs to move (``trace_share_transport.csv``): its size and the
CPU seconds to pickle and load it with torch's ``GraphPickler`` (what the ranks use), against
``torch.export.save`` / ``load``, beside the export itself, interleaved repeats.

Writes ``trace_share.csv``, ``trace_share_transport.csv`` and ``trace_share.png``.

Usage::

    python experiments/bench_trace_share.py            # ~10 minutes on 2 cores
    python experiments/bench_trace_share.py --quick    # a smoke run
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
from hf_decoders import HFDecoderLM
from models import ByteWindows, CharLM
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_parallel import PipelineStrategy
from lightning_parallel.pipeline.microbatches import first_microbatch
from lightning_parallel.sources.traced.call_binding import CallBinding
from lightning_parallel.sources.traced.share import SHARE_ENV, ProgramShare, pack, tally, unpack
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import meta_twin, to_meta

BASELINE = "every_rank"
VARIANTS = (BASELINE, "shared")
MODELS = ("llama", "gpt")


def build(name: str, args: dict[str, Any]) -> L.LightningModule:
    torch.manual_seed(0)
    if name == "llama":
        return HFDecoderLM("llama", dim=args["dim"], depth=args["depth"], seq_len=args["seq_len"])
    return CharLM(dim=args["dim"], depth=args["gpt_depth"], seq_len=args["seq_len"])


def loader(args: dict[str, Any]) -> DataLoader:
    data = ByteWindows.of_stdlib(2 * args["batch_size"], args["seq_len"])
    # Every rank of the pipeline reads the whole batch (one pipeline, no data parallelism).
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(data, batch_size=args["batch_size"], sampler=sampler, drop_last=True)


class FirstStep(L.Callback):
    """When (wall and this process's CPU clock) the first training step ends."""

    wall = cpu = float("nan")

    @override
    def on_train_batch_end(self, *_: Any) -> None:
        if self.wall != self.wall:  # (NaN: the first one)
            self.wall, self.cpu = time.perf_counter(), time.process_time()


def timed_fit(name: str, variant: str, world: int, args: dict[str, Any]) -> dict[str, float]:
    """This rank's part of one fit to the first step: its seconds, its CPU, its export and load CPU."""
    os.environ[SHARE_ENV] = "1" if variant == "shared" else "0"
    model, data = build(name, args), loader(args)
    clock = FirstStep()
    strategy = PipelineStrategy(pipeline_size=world, num_microbatches=args["microbatches"])
    trainer = h.quiet_trainer(devices=world, strategy=strategy, max_steps=1, callbacks=[clock])
    before = dataclasses.replace(tally)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model, train_dataloaders=data)
    spent = {f.name: getattr(tally, f.name) - getattr(before, f.name) for f in dataclasses.fields(tally)}
    return {
        "first_step_s": clock.wall - start,
        "setup_cpu_s": clock.cpu - cpu,
        "trace_cpu_s": spent["export_cpu_s"] + spent["pack_cpu_s"] + spent["receive_cpu_s"],
        "exports": spent["exported"],
        "received": spent["received"],
        "program_mb": spent["sent_bytes"] / 2**20,
    }


def worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    variants = {
        f"{name}/{variant}": (lambda name=name, variant=variant: timed_fit(name, variant, world, args))
        for name in args["models"]
        for variant in VARIANTS
    }
    # (warm-up: the job's first fit pays one-off imports and caches, which no variant should carry)
    return h.interleave(variants, repeats=args["repeats"], before_each=h.barrier, warmup=not args["quick"])


def per_node(ranks: list[list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """One sample per fit: CPU and exports summed over the ranks, the slowest rank's first step."""
    fits = []
    for samples in zip(*ranks, strict=True):
        name, variant = samples[0]["variant"].split("/")
        fit = {"model": name, "ranks": world, "repeat": samples[0]["repeat"], "variant": variant}
        fit["first_step_s"] = max(s["first_step_s"] for s in samples)
        for key in ("setup_cpu_s", "trace_cpu_s", "exports", "received", "program_mb"):
            fit[key] = sum(s[key] for s in samples)
        fits.append(fit)
    return fits


def result_rows(fits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and rank count: each variant's medians and ranges, and its ratios to every_rank."""
    rows = []
    for name in dict.fromkeys(f["model"] for f in fits):
        for world in dict.fromkeys(f["ranks"] for f in fits):
            mine = [f for f in fits if f["model"] == name and f["ranks"] == world]
            ratios = {m: h.compare(mine, m, baseline=BASELINE, ratio=f"{m}_ratio") for m in METRICS}
            for variant in VARIANTS:
                row: dict[str, Any] = {"model": name, "ranks": world, "variant": variant}
                for metric, compared in ratios.items():
                    row |= {k: v for k, v in next(r for r in compared if r["variant"] == variant).items()
                            if k.startswith(metric)}  # fmt: skip
                done = [f for f in mine if f["variant"] == variant]
                row |= {k: round(done[0][k], 3) for k in ("exports", "received", "program_mb")}
                row["repeats"] = len(done)
                rows.append(row)
    return rows


METRICS = ("trace_cpu_s", "setup_cpu_s", "first_step_s")


# ------------------------------------------------------------------------------------ transport


class _Capture(ProgramShare):
    """This process in a receiving rank's place: the export's bytes are kept and loaded back."""

    is_src = False

    def __init__(self) -> None:
        self.group, self.src, self.ranks, self.sent = None, 0, [0], b""

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def decide(self, fn: Any) -> Any:
        self.sent = fn()
        return self.sent

    def together(self) -> Any:
        return contextlib.nullcontext()


def transport(name: str, args: dict[str, Any]) -> dict[str, float]:
    """One export of the model's forward at the bench's shape, then its program moved both ways (CPU s)."""
    model = build(name, args)
    twin = meta_twin(model)
    batch = torch.zeros(args["batch_size"], args["seq_len"], dtype=torch.long)
    binding, tensors = (
        CallBinding.of("model", (), {"input_ids": batch}) if name == "llama" else (None, (batch,))
    )
    example = to_meta(first_microbatch(tensors, args["microbatches"]))
    # the middle block: a two-stage split, as the fits' pipeline of two makes
    points = (
        [f"model.model.layers.{args['depth'] // 2}"] if name == "llama" else [f"h.{args['gpt_depth'] // 2}"]
    )
    capture, before = _Capture(), dataclasses.replace(tally)
    trace(twin, example, points, True, binding, share=capture)
    exported = unpack(capture.sent, twin, torch.device("cpu"))
    out = {
        "export_cpu_s": tally.export_cpu_s - before.export_cpu_s,
        "pickle_mb": len(capture.sent) / 2**20,
        "pickle_cpu_s": _cpu(lambda: pack(exported, torch.device("cpu"))),
        "unpickle_cpu_s": tally.receive_cpu_s - before.receive_cpu_s,
    }
    saved = io.BytesIO()
    exported.program._example_inputs = None  # (fake tensors: torch.export.load warns, then unpickles them)
    out["save_cpu_s"] = _cpu(lambda: torch.export.save(exported.program, saved))
    out["save_mb"] = saved.getbuffer().nbytes / 2**20
    out["load_cpu_s"] = _cpu(lambda: torch.export.load(io.BytesIO(saved.getvalue())))
    return out


def _cpu(fn: Any) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def transport_rows(args: dict[str, Any]) -> list[dict[str, Any]]:
    samples = h.interleave({n: (lambda n=n: transport(n, args)) for n in args["models"]}, args["repeats"])
    rows = []
    for name in args["models"]:
        mine = [s for s in samples if s["variant"] == name]
        row: dict[str, Any] = {"model": name, "repeats": len(mine)}
        for key in ("export_cpu_s", "pickle_cpu_s", "unpickle_cpu_s", "save_cpu_s", "load_cpu_s"):
            row |= h.spread(s[key] for s in mine).cells(key, 3)
        row["pickle_mb"] = round(mine[0]["pickle_mb"], 3)
        row["save_mb"] = round(mine[0]["save_mb"], 3)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------- output


def plot(rows: list[dict[str, Any]], args: Any) -> None:
    fig, axes = h.figure(ncols=2)
    titles = {"trace_cpu_s": "export + share CPU per node (s)", "first_step_s": "time to the first step (s)"}
    for ax, (metric, title) in zip(axes, titles.items()):
        for variant, marker in zip(VARIANTS, "os"):
            mine = [r for r in rows if r["variant"] == variant]
            labels = [f"{r['model']} x{r['ranks']}" for r in mine]
            h.errorbars(ax, labels, mine, metric, fmt=marker, label=variant.replace("_", " "))
        ax.set_title(title)
        ax.legend()
    h.save_figure(fig, args.out_dir / "trace_share.png")


# ------------------------------------------------------------------- its tables in docs/results.md


def trace_share(rows: t.Rows) -> str:
    header = ["model", "ranks", "variant", "repeats", "exports, loads"]
    names = {"trace_cpu_s": "trace CPU", "setup_cpu_s": "setup CPU", "first_step_s": "first step"}
    for name in names.values():
        header += [f"{name} s" + (" per node" if "CPU" in name else ""), f"{name}: ratio to every rank"]
    body = []
    for r in rows:
        cells = [r["model"], r["ranks"], r["variant"].replace("_", " "), r["repeats"]]
        cells.append(f"{t.fixed(r['exports'], 0)}, {t.fixed(r['received'], 0)}")
        for key in names:
            ratio, words = f"{key}_ratio", dict(higher_is_better=False, words=("less", "more"))
            shared = r["variant"] == "shared"
            cells += [
                t.timed_col(r, key, 2),
                t.timed_col(r, ratio, 2, t.ratio_verdict(r, ratio, **words)) if shared else "-",
            ]
        body.append(cells)
    return t.table(header, body) + (
        "\n\nOne training step under `PipelineStrategy(pipeline_size=ranks)`, the traced forward exported by "
        "every rank (as before) or once, by rank 0, the others loading its program "
        "(`sources/traced/share.py`); "
        "interleaved in one job per rank count. Trace CPU: exporting, pickling and loading programs, summed "
        "over the ranks; setup CPU: every rank's from `fit()` to the end of the first step, summed; first "
        "step: `fit()` to the end of the first step on the slowest rank. The ratios are against every rank "
        "exporting, taken within each repeat."
    )


def trace_share_transport(rows: t.Rows) -> str:
    header = ["model", "repeats", "export CPU s", "GraphPickler MB", "pickle CPU s", "its load CPU s",
              "torch.export.save MB", "save CPU s", "torch.export.load CPU s"]  # fmt: skip
    body = [
        [r["model"], r["repeats"], t.timed_col(r, "export_cpu_s", 2), t.fixed(r["pickle_mb"], 2),
         t.timed_col(r, "pickle_cpu_s", 2), t.timed_col(r, "unpickle_cpu_s", 2), t.fixed(r["save_mb"], 2),
         t.timed_col(r, "save_cpu_s", 2), t.timed_col(r, "load_cpu_s", 2)]
        for r in rows
    ]  # fmt: skip
    return t.table(header, body) + (
        "\n\nIn one process: the program of one export moved both ways, what a receiving rank pays against "
        "exporting it itself."
    )


RESULTS = t.Results(
    "trace_share",
    t.Section(
        "Tracing once per job: one rank exports the traced forward for all, against every rank",
        t.Table(
            trace_share,
            (
                "trace_cpu_s",
                "trace_cpu_s_max",
                "trace_cpu_s_ratio",
                "trace_cpu_s_ratio_min",
                "setup_cpu_s",
                "setup_cpu_s_ratio",
                "first_step_s",
                "first_step_s_min",
                "first_step_s_ratio",
                "first_step_s_ratio_max",
                "exports",
                "received",
            ),
            timed=True,
        ),
        t.Table(
            trace_share_transport,
            (
                "export_cpu_s",
                "export_cpu_s_max",
                "pickle_mb",
                "pickle_cpu_s",
                "unpickle_cpu_s",
                "unpickle_cpu_s_min",
                "save_mb",
                "save_cpu_s",
                "load_cpu_s",
                "load_cpu_s_max",
            ),
            timed=True,
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    h.add_model_args(p)
    p.set_defaults(depth=8, batch_size=16)
    p.add_argument("--gpt-depth", type=int, default=4, help="the GPT's blocks (default 4)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = p.parse_args(argv)
    args.models = list(MODELS)
    if args.quick:
        # the GPT only (tests/test_trace_share.py shares a Hugging Face Llama's program)
        args.repeats, args.dim, args.depth, args.gpt_depth, args.ranks, args.models = (
            1,
            32,
            2,
            2,
            [2],
            ["gpt"],
        )
        args.seq_len, args.batch_size, args.microbatches = 16, 8, 2
    h.quiet()
    h.record_machine("trace_share", args.out_dir)
    cfg = {k: v for k, v in vars(args).items() if k != "out_dir"}
    fits = [f for world in args.ranks for f in per_node(h.spawn(worker, world, cfg), world)]
    rows = result_rows(fits)
    h.write_csv(args.out_dir / "trace_share.csv", rows)
    moved = transport_rows(cfg)
    h.write_csv(args.out_dir / "trace_share_transport.csv", moved)
    plot(rows, args)
    for row in rows + moved:
        print(row)


if __name__ == "__main__":
    main()
