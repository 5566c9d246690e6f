"""Fine-tuning data as users bring it: each batch padded to its own length, against fixed padding.

The data: prompt/response samples of the standard library's bytes, one batch of 8 per length from 8 to
70 bytes (32 batches, 32 distinct lengths, in a shuffled order), prompts (the first third of each
sample) and padding labelled -100. The model: a Hugging Face Llama from a config (width 128, 4 decoder
layers, byte vocabulary), its loss taken from ``labels=`` as fine-tuning scripts do. Three variants of
one epoch, interleaved repeats inside ONE spawned job of 2 processes:

* **dynamic**: ``PipelineStrategy(pipeline_size=2, num_microbatches=4)``, each batch as long as its
  longest sample (32 shapes);
* **fixed**: the same, every batch padded to 70 (one shape: what the pipeline was fast at before);
* **one process**: ``Trainer(devices=1)`` on rank 0 with dynamic padding (rank 1 waits at a barrier).

Reported per variant: the fit's seconds (``trainer.fit``, setup and tracing included), steps per second
and labelled tokens per second (the median step cycle after 3 steps), how many times forward was
traced, and dynamic / fixed within each repeat (goal: at most 1.2). Then, in one process, what meeting
a new length costs for a 32-layer Llama: the one trace with dynamic sizes (paid once per run), building
the stages for each new length from it (goal: under 0.2 s), and, for comparison, the trace at one
static shape that each new length used to cost; and for the same depth held in a top-level Sequential:
sizing a new length's stages on fake tensors, the one export of its layers, a new length after it.

Writes ``varlen.csv``, ``varlen_new_length.csv`` and ``varlen.png``.

Usage::

    python experiments/bench_varlen.py            # about 3 minutes on 2 cores
    python experiments/bench_varlen.py --quick    # a smoke run
"""

from __future__ import annotations

import time
from typing import Any

import _harness as h
import _tables as t
import torch
import torch.distributed as dist
from hf_decoders import HFDecoderLM
from models import ByteWindows
from torch.utils.data import DataLoader

from lightning_parallel import PipelineStrategy
from lightning_parallel.sources.traced.call_binding import CallBinding
from lightning_parallel.sources.traced.stages import TracedStages
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import alias_table, meta_twin, to_meta

BASELINE = "fixed"
VARIANTS = ("dynamic", "fixed", "one_process")
LONGEST = 70


class FineTuneLM(HFDecoderLM):
    """The Llama fine-tuned on prompt/response batches: the loss is the model's own, from ``labels=``."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"])  # fmt: skip
        self.log("train_loss", out.loss)
        return out.loss


def batches(count: int, batch_size: int, fixed: int | None, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` batches, batch ``k`` as long as its longest sample (8 + 2k bytes), in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    text = ByteWindows.of_stdlib(count * batch_size, LONGEST)
    out = []
    for k in torch.randperm(count, generator=g).tolist():
        longest = 8 + 2 * k
        others = torch.randint(longest // 2, longest + 1, (batch_size - 1,), generator=g).tolist()
        lengths = [longest, *others]
        t = fixed or longest
        batch = {
            "input_ids": torch.zeros(batch_size, t, dtype=torch.long),
            "attention_mask": torch.zeros(batch_size, t, dtype=torch.long),
            "labels": torch.full((batch_size, t), -100, dtype=torch.long),
        }
        for row, n in enumerate(lengths):
            ids = text[(k * batch_size + row) % len(text)][0][:n]
            batch["input_ids"][row, :n], batch["attention_mask"][row, :n] = ids, 1
            batch["labels"][row, n // 3 : n] = ids[n // 3 :]
        out.append(batch)
    return out


def timed_fit(variant: str, devices: int, args: dict[str, Any]) -> dict[str, Any]:
    data = batches(args["batches"], args["batch_size"], LONGEST if variant == "fixed" else None)
    strategy: Any = "auto"
    if devices > 1:
        strategy = PipelineStrategy(pipeline_size=devices, num_microbatches=args["microbatches"])
    clock = h.StepClock()
    trainer = h.quiet_trainer(devices=devices, strategy=strategy, max_epochs=1, callbacks=[clock],
                              use_distributed_sampler=False)  # fmt: skip
    torch.manual_seed(0)
    model = FineTuneLM("llama", dim=args["dim"], depth=args["depth"], seq_len=128)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=None))
    fit_s = time.perf_counter() - start
    cycle = clock.cycle_quantile_s(args["warmup"])
    labelled = sum(int((b["labels"][:, 1:] != -100).sum()) for b in data) / len(data)
    stages = trainer.strategy.parts.runner.stages if devices > 1 else None
    return {
        "fit_s": fit_s,
        "steps_per_s": 1.0 / cycle,
        "tokens_per_s": labelled / cycle,
        "traces": getattr(stages, "traces", 0),
        "lengths": len({b["input_ids"].shape[1] for b in data}),
    }


def _alone(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    result = timed_fit("one_process", 1, args) if rank == 0 else {}
    h.barrier()
    return result


def worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    variants = {
        "dynamic": lambda: timed_fit("dynamic", world, args),
        "fixed": lambda: timed_fit("fixed", world, args),
        "one_process": lambda: _alone(rank, args),
    }
    return h.interleave(variants, repeats=args["repeats"], before_each=h.barrier)


def result_rows(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each variant from the rank that measured it (the pipeline's last stage; one process on rank 0)."""
    source = {"dynamic": ranks[-1], "fixed": ranks[-1], "one_process": ranks[0]}
    samples = [s for v in VARIANTS for s in source[v] if s["variant"] == v]
    samples.sort(key=lambda s: (s["repeat"], s["position"]))
    rows = h.compare(samples, "fit_s", baseline=BASELINE)
    for row in rows:
        mine = [s for s in samples if s["variant"] == row["variant"]]
        row |= h.spread(s["steps_per_s"] for s in mine).cells("steps_per_s", 3)
        row |= h.spread(s["tokens_per_s"] for s in mine).cells("tokens_per_s", 1)
        row["traces"], row["lengths"] = max(s["traces"] for s in mine), mine[0]["lengths"]
        row["goal"] = 1.2
    return rows


def new_length_costs(args: dict[str, Any]) -> list[dict[str, Any]]:
    """A 32-layer Llama in one process: the one dynamic trace, each new length's stages, a static trace."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = HFDecoderLM("llama", dim=64, depth=args["deep"], seq_len=256)
    twin = meta_twin(model)
    points = [f"model.model.layers.{args['deep'] // 2}"]

    def example(length: int) -> tuple[CallBinding, tuple[torch.Tensor, ...]]:
        return CallBinding.of("model", (), {"input_ids": torch.zeros(2, length, dtype=torch.long)})

    binding, tensors = example(40)
    start = time.perf_counter()
    pipe = trace(twin, to_meta(tensors), points, True, binding)
    dynamic_s = time.perf_counter() - start
    stages = TracedStages(
        twin, points, [0], model, alias_table(model), torch.device("cpu"), None, {True: binding}
    )
    stages.keep_for_later(True, to_meta(tensors), pipe)
    stages.build("train", 4, tensors)  # (prepares the stage graph once: pointed at the real weights)
    builds = []
    for length in torch.randperm(200, generator=torch.Generator().manual_seed(1))[: args["lengths"]].tolist():
        _, new = example(length + 2)
        start = time.perf_counter()
        stages.build("train", 4, new)
        builds.append(time.perf_counter() - start)
    statics = []
    for length in (23, 57, 91)[: max(1, args["repeats"] // 2)]:
        b, new = example(length)
        start = time.perf_counter()
        trace(twin, to_meta(new), points, True, b, dynamic=False)
        statics.append(time.perf_counter() - start)
    fake, chained, export_s = sequential_costs(args)
    rows = [
        {"what": "trace with dynamic sizes (once per run and mode)", **h.spread([dynamic_s]).cells("s", 3)},
        {"what": "stages for a new length, from that trace", **h.spread(builds).cells("s", 4)},
        {"what": "trace at one static shape (each new length, before)", **h.spread(statics).cells("s", 3)},
        {"what": "Sequential: a new length's stages sized on fake tensors", **h.spread(fake).cells("s", 4)},
        {
            "what": "Sequential: its layers exported with dynamic sizes (once)",
            **h.spread([export_s]).cells("s", 3),
        },
        {"what": "Sequential: a new length's stages from that export", **h.spread(chained).cells("s", 4)},
    ]
    for row in rows:
        row |= {"layers": args["deep"], "traces": stages.traces, "goal_s": 0.2}
    return rows


def sequential_costs(args: dict[str, Any]) -> tuple[list[float], list[float], float]:
    """The same depth as a top-level Sequential (``SequentialCharLM``, width 64), split in two: seconds per
    new length on fake tensors (its first two shapes), the one export at its third, per length after."""
    from models import SequentialCharLM

    from lightning_parallel.layout.ranks import RankLayout
    from lightning_parallel.pipeline.plan import make_plan
    from lightning_parallel.sources.sequential.split import stage_descriptions, stage_twins
    from lightning_parallel.sources.sequential.stages import SequentialStages

    model = SequentialCharLM(dim=64, depth=args["deep"], seq_len=256)
    half = len(model.layers) // 2
    units, holds = stage_descriptions(model.layers, [half, len(model.layers) - half])
    plan = make_plan(units, holds, [1, 1], RankLayout(pp_size=2, dp_size=1))
    stages = SequentialStages([], [], 2, torch.device("cpu"), None, stage_twins(model.layers, plan))
    lengths = [n + 2 for n in torch.randperm(200, generator=torch.Generator().manual_seed(2)).tolist()]

    def timed(length: int) -> float:
        start = time.perf_counter()
        stages._shapes(True, (torch.zeros(2, length, dtype=torch.long),))
        return time.perf_counter() - start

    fake = [timed(lengths[0]), timed(lengths[1])]
    export_s = timed(lengths[2])  # the third shape: sized on fakes, then the layers are exported
    chained = [timed(n) for n in lengths[3 : 3 + args["lengths"]]]
    return fake, chained, export_s


def plot(rows: list[dict[str, Any]], costs: list[dict[str, Any]], args: Any) -> None:
    fig, (left, right) = h.figure(ncols=2)
    names = {"dynamic": "pipeline,\ndynamic padding", "fixed": "pipeline,\nfixed padding",
             "one_process": "one process,\ndynamic padding"}  # fmt: skip
    h.errorbars(left, [names[r["variant"]] for r in rows], rows, "tokens_per_s", fmt="o")
    left.set_title(f"Llama {args.dim} x {args.depth}, {rows[0]['lengths']} lengths: labelled tokens/s")
    labels = [
        "traced: dynamic trace (once)",
        "traced: a new length",
        "traced: static trace\n(per length, before)",
        "Sequential: fake run\n(per length)",
        "Sequential: export (once)",
        "Sequential: a new length",
    ]
    colors = ["tab:blue", "tab:green", "tab:red", "tab:orange", "tab:purple", "tab:olive"]
    right.barh(range(len(costs)), [float(c["s"]) for c in costs], color=colors[: len(costs)])
    right.set_yticks(range(len(costs)), labels[: len(costs)])
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_title(f"meeting a new length, {args.deep} layers (s, log)")
    h.save_figure(fig, args.out_dir / "varlen.png")


# ------------------------------------------------------------------- its tables in docs/results.md


def varlen(rows: t.Rows) -> str:
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
        ratio = "1 (baseline)" if name == "fixed" else t.timed_col(r, "ratio", 3)
        if name == "dynamic":
            ratio = t.timed_col(r, "ratio", 3, t.ratio_verdict(r, "ratio", goal=goal, higher_is_better=False))
        table.append([names[name], r["lengths"], r["traces"], r["repeats"], t.timed_col(r, "fit_s", 2), ratio,
                      t.timed_col(r, "steps_per_s", 1), t.timed_col(r, "tokens_per_s", 0)])  # fmt: skip
    return t.table(header, table) + (
        "\n\nOne epoch of prompt/response batches, one batch per length (prompts and padding labelled as "
        "ignored, the loss the Llama's own from `labels=`, token-exact), interleaved in the same 2 "
        "processes; the fit includes setup and tracing; medians with (min .. max) over the repeats, the "
        f"ratio taken within each repeat (goal: at most {goal})."
    )


def varlen_new_length(rows: t.Rows) -> str:
    table = [[r["what"], r["layers"], t.timed_col(r, "s", 4)] for r in rows]
    return t.table(["what", "decoder layers", "seconds"], table) + (
        "\n\nA deep Llama in one process, split in two: the one trace with dynamic sizes is paid once per "
        "run and mode; each new length then costs building its stages from it (goal: under "
        f"{rows[0]['goal_s']} s), where it used to cost a whole static trace. The same depth held in a "
        "top-level Sequential: its first shapes are sized on fake tensors, and at a mode's third shape its "
        "layers are exported once with dynamic sizes (that row includes the third shape's fake run)."
    )


RESULTS = t.Results(
    "varlen",
    t.Section(
        "Fine-tuning data: dynamic padding against fixed padding, and what a new length costs",
        t.Table(
            varlen,
            ("fit_s", "fit_s_max", "ratio", "ratio_min", "steps_per_s", "tokens_per_s", "traces", "lengths"),
        ),
        t.Table(varlen_new_length, ("s", "s_min", "s_max", "layers")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=32, help="batches per epoch, one length each (default 32)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--deep", type=int, default=32, help="layers of the model whose new lengths are timed")
    p.add_argument("--lengths", type=int, default=10, help="new lengths timed on the deep model")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.batches, args.deep, args.lengths = 1, 3, 2, 2
        args.dim, args.depth, args.warmup, args.microbatches = 32, 2, 1, 2
    h.quiet()
    h.record_machine("varlen", args.out_dir)
    cfg = {k: v for k, v in vars(args).items() if k != "out_dir"}
    rows = result_rows(h.spawn(worker, 2, cfg))
    h.write_csv(args.out_dir / "varlen.csv", rows)
    costs = new_length_costs(cfg)
    h.write_csv(args.out_dir / "varlen_new_length.csv", costs)
    plot(rows, costs, args)
    for row in rows + costs:
        print(row)


if __name__ == "__main__":
    main()
