"""A GPT pipelined two ways: its forward traced (the GPT as written) against its layers in a Sequential.

The main job's model (``models.CharLM``: embeddings, a ModuleList of blocks, head tied to the token
embedding) and the same network with its layers in one ``nn.Sequential`` (``SequentialCharLM(tied=True)``,
same weights, same stage boundaries: embeddings + 2 blocks | 2 blocks + norm + head) train on the same
2 processes under ``PipelineStrategy``, interleaved repeats. Reported:

* **throughput**: traced / Sequential samples per second, the median of the per-repeat ratios and their
  range (goal >= 0.97), and the largest loss difference between the two (they compute the same thing);
* **tied gradients**: the time of the one all-reduce that sums the tied weight's replica gradients,
  as a share of the step (measured on the trained pipeline, in the same processes);
* **tracing**: seconds to trace ``forward`` again at a new input shape (a new sequence length), in one
  process, interleaved over the shapes.

Writes ``gpt_pipeline.csv``, ``gpt_tracing.csv`` and ``gpt_pipeline.png``.

Usage::

    python experiments/bench_gpt_pipeline.py            # a few minutes on 2 cores
    python experiments/bench_gpt_pipeline.py --quick    # a smoke run
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import _harness as h
import _tables as t
import torch
from models import ByteWindows, CharLM, SequentialCharLM, adamw_with_cosine_decay
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import PipelineStrategy
from lightning_parallel.pipeline.microbatches import first_microbatch
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import meta_twin, to_meta

GOAL = 0.97  # the traced path keeps at least this share of the Sequential path's throughput


def gpt(args: dict[str, Any]) -> CharLM:
    torch.manual_seed(0)
    return CharLM(dim=args["dim"], depth=args["depth"], seq_len=args["seq_len"])


class SequentialGPT(SequentialCharLM):
    """SequentialCharLM trained as CharLM is (AdamW with the cosine decay)."""

    def configure_optimizers(self) -> Any:
        return adamw_with_cosine_decay(self)


def sequential_twin(model: CharLM, args: dict[str, Any]) -> SequentialCharLM:
    """The same network and weights with its layers in one Sequential (tied head, no head bias)."""
    seq = SequentialGPT(dim=args["dim"], depth=args["depth"], seq_len=args["seq_len"], tied=True)
    depth, state = args["depth"], model.state_dict()
    renamed = {
        "layers.0.tokens.weight": state["wte.weight"],
        "layers.0.positions.weight": state["wpe.weight"],
    }
    for key, value in state.items():
        if key.startswith("h."):
            index, rest = key[2:].split(".", 1)
            renamed[f"layers.{int(index) + 1}.{rest}"] = value
        elif key.startswith("ln_f."):
            renamed[f"layers.{depth + 1}.{key[5:]}"] = value
    renamed[f"layers.{depth + 2}.weight"] = state["lm_head.weight"]
    seq.load_state_dict(renamed)
    return seq


def loader(args: dict[str, Any]) -> DataLoader:
    steps = args["warmup"] + args["steps"]
    data = ByteWindows.of_stdlib((steps + 2) * args["batch_size"], args["seq_len"])
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=args["batch_size"], sampler=sampler, drop_last=True)


def timed_fit(traced: bool, world: int, args: dict[str, Any]) -> dict[str, Any]:
    model = gpt(args)
    # Sequential: [embedding, blocks..., norm, head]; the traced split puts depth/2 blocks per stage.
    half = args["depth"] // 2
    partition = "uniform" if traced else [1 + half, args["depth"] - half + 2]
    strategy = PipelineStrategy(
        pipeline_size=world, num_microbatches=args["microbatches"], partition=partition
    )
    clock = h.StepClock()
    trainer = h.quiet_trainer(
        devices=world, strategy=strategy, max_steps=args["warmup"] + args["steps"], callbacks=[clock]
    )
    trainer.fit(model if traced else sequential_twin(model, args), train_dataloaders=loader(args))
    step_ms = clock.median_step_ms(args["warmup"])
    out = {
        "samples_per_s": args["batch_size"] / clock.cycle_quantile_s(args["warmup"]),
        "step_ms": step_ms,
        "losses": clock.losses,
    }
    if traced:
        out["tied_ms"] = _tied_sum_ms(strategy)
        out["tied_share"] = out["tied_ms"] / step_ms
    return out


def _tied_sum_ms(strategy: PipelineStrategy, repeats: int = 30) -> float:
    """Median time of the tied weight's gradient sum (the collective the traced GPT adds per step)."""
    shared = strategy.parts.shared
    times = []
    for _ in range(repeats):
        h.barrier()
        start = time.perf_counter()
        shared.sum_gradients()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    variants = {
        "sequential": lambda: timed_fit(False, world, args),
        "traced": lambda: timed_fit(True, world, args),
    }
    return h.interleave(variants, repeats=args["repeats"], before_each=h.barrier)


def tracing_times(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Seconds to trace forward at each sequence length (a new shape), interleaved over the lengths."""
    twin = meta_twin(gpt(args))
    points = [f"h.{args['depth'] // 2}"]

    def timed(seq_len: int) -> float:
        batch = (torch.zeros(args["batch_size"], seq_len, dtype=torch.long),)
        example = to_meta(first_microbatch(batch, args["microbatches"]))
        start = time.perf_counter()
        trace(twin, example, points, train=True)
        return time.perf_counter() - start

    return h.seconds_by_length(timed, args["seq_len"], args["repeats"], args["quick"])


# ------------------------------------------------------------------- its tables in docs/results.md


def gpt_pipeline(rows: t.Rows) -> str:
    by = {r["variant"]: r for r in rows}
    seq, traced, goal = by["sequential"], by["traced"], rows[0]["goal"]
    verdict = t.ratio_verdict(traced, "ratio", goal=float(goal))
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
        ["Sequential (`SequentialCharLM`)", seq["repeats"], t.timed_col(seq, "samples_per_s", 1),
         t.timed_col(seq, "step_ms", 1), "1 (baseline)", seq["max_loss_diff"], "-", "-"],
        ["traced (`CharLM`, the GPT as written)", traced["repeats"], t.timed_col(traced, "samples_per_s", 1),
         t.timed_col(traced, "step_ms", 1), t.timed_col(traced, "ratio", 3, verdict), traced["max_loss_diff"],
         t.timed_col(traced, "tied_ms", 3), t.timed_col(traced, "tied_share", 4)],
    ]  # fmt: skip
    return t.table(header, table) + (
        "\n\nSame weights, same stage boundaries (embeddings + 2 blocks | 2 blocks + norm + tied head), "
        "interleaved in the same 2 processes; medians with (min .. max) over the repeats."
    )


def gpt_tracing(rows: t.Rows) -> str:
    table = [[r["seq_len"], r["repeats"], t.timed_col(r, "trace_s", 2)] for r in rows]
    return t.table(["sequence length", "repeats", "seconds to trace forward at that shape"], table) + (
        "\n\nPaid once per run and mode: the trace has dynamic sizes, so other lengths and the short last "
        "batch use it too (see the fine-tuning benchmark)."
    )


RESULTS = t.Results(
    "gpt_pipeline",
    t.Section(
        "Pipelining a GPT: its forward traced against its layers in a Sequential",
        t.Table(gpt_pipeline, ("samples_per_s", "step_ms", "ratio", "tied_ms", "tied_share")),
        t.Table(gpt_tracing, ("trace_s", "trace_s_min", "trace_s_max")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    h.add_model_args(p)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.steps, args.dim, args.depth = 1, 1, 1, 32, 2
        args.seq_len, args.batch_size = 16, 8
    h.quiet()
    h.record_machine("gpt_pipeline", args.out_dir)
    cfg = {k: v for k, v in vars(args).items() if k != "out_dir"}
    samples = h.spawn(worker, 2, cfg)[1]  # the last stage: it computes the loss
    rows = h.compare(samples, "samples_per_s", baseline="sequential")
    seq_losses = next(s["losses"] for s in samples if s["variant"] == "sequential")
    for row in rows:
        mine = [s for s in samples if s["variant"] == row["variant"]]
        row |= h.spread(s["step_ms"] for s in mine).cells("step_ms", 2)
        row["max_loss_diff"] = max(abs(a - b) for s in mine for a, b in zip(s["losses"], seq_losses))
        row["goal"] = GOAL
        if row["variant"] == "traced":
            row |= h.spread(s["tied_ms"] for s in mine).cells("tied_ms", 3)
            row |= h.spread(s["tied_share"] for s in mine).cells("tied_share", 4)
    h.write_csv(args.out_dir / "gpt_pipeline.csv", rows)
    tracing = tracing_times(cfg)
    h.write_csv(args.out_dir / "gpt_tracing.csv", tracing)
    fig, (left, right) = h.figure(ncols=2)
    h.errorbars(left, [r["variant"] for r in rows], rows, "samples_per_s", label="samples/s")
    left.set_title("throughput, 2 pipeline stages")
    h.errorbars(right, [r["seq_len"] for r in tracing], tracing, "trace_s", label="trace")
    right.set_title("tracing forward at a new shape (s)")
    right.set_xlabel("sequence length")
    h.save_figure(fig, args.out_dir / "gpt_pipeline.png")
    for row in rows:
        print(row)
    for row in tracing:
        print(row)


if __name__ == "__main__":
    main()
