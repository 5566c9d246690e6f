"""A Hugging Face Llama, unmodified, pipelined over 2 processes against the same model in one process.

The model: ``HFDecoderLM("llama", dim=128, depth=8, seq_len=64)`` (``experiments/hf_decoders.py``: a
``transformers`` LlamaForCausalLM built from a config, tied embeddings; its step calls
``self.model(input_ids=x).logits``, as a fine-tuning script does), next-byte prediction on the standard
library's text (``models.ByteWindows.of_stdlib``), same seed and same batches in every fit. Two
variants, interleaved repeats inside ONE spawned job of 2 processes:

* **pipeline**: ``PipelineStrategy(pipeline_size=2, num_microbatches=4)`` (1F1B) on both processes; the
  traced path splits the Llama before ``model.model.layers.4`` (4 decoder layers per stage);
* **one process** (the baseline): ``Trainer(devices=1)`` on rank 0 trains the whole model on the whole
  batch, while rank 1 waits at a barrier (it computes nothing meanwhile).

Reported:

* **throughput**: pipeline / one process samples per second (the median step cycle after the warm-up;
  the pipeline's clock is rank 1's, the last stage, which computes the loss), the median of the
  per-repeat ratios and their min-max range; with 4 micro-batches the bubble alone caps it at
  2 x 4 / 5 = 1.6 on two free cores;
* **the largest loss difference** between the two over the steps: same weights, same batches, the
  same arithmetic split in micro-batches, so it should be ~1e-6;
* **tracing**: seconds to trace the meta twin of the LightningModule through the step's call
  (``self.model(input_ids=x)``, bound with ``CallBinding``) and split it, at a new input shape (3
  sequence lengths), in one process, interleaved over the lengths. Paid once per new shape.

Writes ``hf_pipeline.csv``, ``hf_tracing.csv`` and ``hf_pipeline.png``.

Usage::

    python experiments/bench_hf_pipeline.py            # a few minutes on 2 cores
    python experiments/bench_hf_pipeline.py --quick    # a smoke run
"""

from __future__ import annotations

import math
import time
from typing import Any

import _harness as h
import _tables as t
import torch
from hf_decoders import HFDecoderLM
from models import ByteWindows
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import PipelineStrategy
from lightning_parallel.pipeline.microbatches import first_microbatch
from lightning_parallel.sources.traced.call_binding import CallBinding
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import meta_twin, to_meta

BASELINE = "one_process"


def llama(args: dict[str, Any]) -> HFDecoderLM:
    torch.manual_seed(0)
    return HFDecoderLM("llama", dim=args["dim"], depth=args["depth"], seq_len=args["seq_len"])


def loader(args: dict[str, Any]) -> DataLoader:
    steps = args["warmup"] + args["steps"]
    data = ByteWindows.of_stdlib((steps + 2) * args["batch_size"], args["seq_len"])
    # Every rank of the pipeline reads the whole batch (one pipeline, no data parallelism).
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=args["batch_size"], sampler=sampler, drop_last=True)


def timed_fit(devices: int, args: dict[str, Any]) -> dict[str, Any]:
    """One fit of the Llama: pipelined over ``devices`` processes, or whole in this one (``devices=1``)."""
    strategy: Any = "auto"
    if devices > 1:
        strategy = PipelineStrategy(pipeline_size=devices, num_microbatches=args["microbatches"])
    clock = h.StepClock()
    trainer = h.quiet_trainer(
        devices=devices, strategy=strategy, max_steps=args["warmup"] + args["steps"], callbacks=[clock]
    )
    trainer.fit(llama(args), train_dataloaders=loader(args))
    return {
        "samples_per_s": args["batch_size"] / clock.cycle_quantile_s(args["warmup"]),
        "step_ms": clock.median_step_ms(args["warmup"]),
        "losses": clock.losses,
    }


def _alone(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    """The whole model on rank 0 while the other ranks wait at the barrier."""
    result = timed_fit(1, args) if rank == 0 else {}
    h.barrier()
    return result


def worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    variants = {BASELINE: lambda: _alone(rank, args), "pipeline": lambda: timed_fit(world, args)}
    return h.interleave(variants, repeats=args["repeats"], before_each=h.barrier)


def measured(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each variant's samples from the rank that measured it: one process on rank 0, the pipeline on
    its last stage (where the loss is)."""
    source = {BASELINE: ranks[0], "pipeline": ranks[-1]}
    return [s for variant, samples in source.items() for s in samples if s["variant"] == variant]


def result_rows(samples: list[dict[str, Any]], stages: int, microbatches: int) -> list[dict[str, Any]]:
    """Medians, ratios against one process within each repeat, and the largest loss difference."""
    samples = sorted(samples, key=lambda s: (s["repeat"], s["position"]))
    rows = h.compare(samples, "samples_per_s", baseline=BASELINE)
    one = {s["repeat"]: s["losses"] for s in samples if s["variant"] == BASELINE}
    for row in rows:
        mine = [s for s in samples if s["variant"] == row["variant"]]
        row |= h.spread(s["step_ms"] for s in mine).cells("step_ms", 2)
        diffs = [abs(a - b) for s in mine for a, b in zip(s["losses"], one[s["repeat"]], strict=True)]
        # A NaN (a step without a loss) must show, not vanish in max().
        row["max_loss_diff"] = f"{float('nan') if any(map(math.isnan, diffs)) else max(diffs):.2e}"
        # 1F1B's bubble: the stages idle for (stages - 1) of the (microbatches + stages - 1) slots.
        ideal = stages * microbatches / (microbatches + stages - 1) if row["variant"] != BASELINE else 1
        row["ideal_ratio"] = round(ideal, 3)
    return rows


def tracing_times(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Seconds to trace and split the step's call at each sequence length, interleaved over the lengths."""
    twin = meta_twin(llama(args))
    points = [f"model.model.layers.{args['depth'] // 2}"]

    def timed(seq_len: int) -> float:
        x = torch.zeros(args["batch_size"], seq_len, dtype=torch.long)
        binding, tensors = CallBinding.of("model", (), {"input_ids": x})
        example = to_meta(first_microbatch(tensors, args["microbatches"]))
        start = time.perf_counter()
        trace(twin, example, points, True, binding)
        return time.perf_counter() - start

    return h.seconds_by_length(timed, args["seq_len"], args["repeats"], args["quick"])


def plot(rows: list[dict[str, Any]], tracing: list[dict[str, Any]], args: Any) -> None:
    fig, (left, right) = h.figure(ncols=2)
    names = {BASELINE: "one process", "pipeline": "2 pipeline stages"}
    h.errorbars(left, [names[r["variant"]] for r in rows], rows, "samples_per_s", fmt="o")
    left.set_title(f"Llama ({args.dim} x {args.depth}): samples/s")
    h.errorbars(right, [r["seq_len"] for r in tracing], tracing, "trace_s", marker="o")
    right.set_title("tracing + split at a new shape (s)")
    right.set_xlabel("sequence length")
    h.save_figure(fig, args.out_dir / "hf_pipeline.png")


# ------------------------------------------------------------------- its tables in docs/results.md


def hf_pipeline(rows: t.Rows) -> str:
    by = {r["variant"]: r for r in rows}
    one, pipe = by["one_process"], by["pipeline"]
    verdict = t.ratio_verdict(pipe, "ratio", words=("faster", "slower"))
    header = ["run", "repeats", "samples/s", "step ms", "pipeline / one process", "max loss diff"]
    table = [
        ["one process (`Trainer(devices=1)`, the other rank idle)", one["repeats"],
         t.timed_col(one, "samples_per_s", 1), t.timed_col(one, "step_ms", 1), "1 (baseline)", "-"],
        ["2 pipeline stages (`PipelineStrategy`, 4 micro-batches)", pipe["repeats"],
         t.timed_col(pipe, "samples_per_s", 1), t.timed_col(pipe, "step_ms", 1),
         t.timed_col(pipe, "ratio", 3, verdict), pipe["max_loss_diff"]],
    ]  # fmt: skip
    return t.table(header, table) + (
        "\n\nA `transformers` Llama built from a config and left as is (the step calls "
        "`self.model(input_ids=x).logits`), traced and split between its middle decoder layers; "
        "interleaved with the one-process run in the same 2 processes, same seed and batches; medians "
        "with (min .. max) over the repeats, the ratio taken within each repeat. The bubble alone caps "
        f"the ratio at {pipe['ideal_ratio']} (on as many free cores as stages)."
    )


def hf_tracing(rows: t.Rows) -> str:
    table = [[r["seq_len"], r["repeats"], t.timed_col(r, "trace_s", 2)] for r in rows]
    header = ["sequence length", "repeats", "seconds to trace and split `self.model(input_ids=x)`"]
    return t.table(header, table) + (
        "\n\nOn the meta twin, in one process: paid once per run and mode (the trace has dynamic sizes)."
    )


RESULTS = t.Results(
    "hf_pipeline",
    t.Section(
        "Pipelining a Hugging Face Llama, unmodified: 2 stages against one process",
        t.Table(
            hf_pipeline,
            ("samples_per_s", "samples_per_s_min", "step_ms", "ratio", "ratio_max", "max_loss_diff"),
            timed=True,
        ),
        t.Table(hf_tracing, ("trace_s", "trace_s_min", "trace_s_max")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    h.add_model_args(p)
    p.set_defaults(depth=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    if args.depth < 2:
        p.error(f"--depth ({args.depth}) must be at least 2: the pipeline splits the layers in two halves")
    if args.quick:
        args.repeats, args.warmup, args.steps, args.dim, args.depth = 1, 1, 1, 32, 2
        args.seq_len, args.batch_size = 16, 8
    h.quiet()
    h.record_machine("hf_pipeline", args.out_dir)
    cfg = {k: v for k, v in vars(args).items() if k != "out_dir"}
    samples = measured(h.spawn(worker, 2, cfg))
    rows = result_rows(samples, 2, args.microbatches)
    h.write_csv(args.out_dir / "hf_pipeline.csv", rows)
    tracing = tracing_times(cfg)
    h.write_csv(args.out_dir / "hf_tracing.csv", tracing)
    plot(rows, tracing, args)
    for row in rows + tracing:
        print(row)
    for s in (s for s in samples if s["repeat"] == 0):
        print(f"{s['variant']} losses, repeat {s['repeat']}: {s['losses']}")


if __name__ == "__main__":
    main()
