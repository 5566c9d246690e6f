"""Long context: the longest sequence that trains within a memory budget with the sequence split over k ranks.

``PipelineStrategy(pipeline_size=1, sequence_parallel_size=k)`` (Ulysses: each sample's tokens split over
``k`` ranks, an all-to-all around ``F.scaled_dot_product_attention``) for k = 1, 2, 4, on a small GPT
written with SDPA (``models.SequentialCharLM``: width 64, 2 blocks, 4 heads, a byte vocabulary, AdamW),
one sample a step; k = 1 is one process, k = 2 and 4 spawned gloo ranks (4 processes on the 2 cores).

- **Memory.** Each rank's peak of the second training step, counted by torch's ``MemTracker``
  (``_meters.StepMeter``: parameters, gradients, AdamW state, activations, the exchange buffers), at
  sequence lengths 256 .. 4096 (8192 with k = 4); the worst rank's peak per (k, length). Then, for a
  budget of k = 1's peak at 1024 tokens (rounded up to a whole MiB), the longest length whose peak
  fits, per k: linearly interpolated between the two measured lengths around the budget, rounded down to
  a multiple of k ("at least" the longest measured when every measured length fits). Goal: k = 2 fits at
  least 1.8x k = 1's length. Beside each, the memory planner's prediction of the same plan
  (``planner.estimate.predict`` of ``sequence_parallel_size=k`` on k devices, the worst rank's).
- **Exactness.** The loss of the first 3 steps (2 optimizer steps in between) at k = 2 and 4, the
  shards' losses weighted by their labelled tokens (the GPT: every token, equal counts), against k =
  1's, at 1024 tokens (same data, same initial weights); byte counts and losses are measured once, they
  do not depend on the load.
- **Time.** The step time per token at 1024 and 4096 tokens (rank 0's median step after 2 warm-up
  steps, the ranks lined up around each step), k = 1, 2, 4 interleaved over ``--repeats`` spawned jobs
  (each fits at both lengths), and the ratio to k = 1 within each repeat. On 2 shared cores k = 4 runs 4
  processes on 2 cores: read the time as what the exchanges, the gradient all-reduce over the k ranks
  and the extra processes cost or save here, not as what k devices would gain.

Writes ``long_context.csv`` (one row per k x length: peak, fits, predicted), ``long_context_fit.csv``
(per k: the budget, the longest length that fits, its ratio to k = 1, the loss difference to k = 1),
``long_context_time.csv`` (per length x k: step, per token, ratio to k = 1) and ``long_context.png``
under ``--out-dir``.

``--model llama``: the same on a Hugging Face ``LlamaForCausalLM`` (``hf_decoders``: width 64, 2 layers,
4 query and 2 key/value heads, SDPA) fine-tuned as users do, with its own loss, ``self.model(input_ids=x,
labels=x).loss`` (the model shifts the labels; the strategy gives each shard the next shard's first
label), k = 1 and 2, lengths 256 .. 2048; its files are ``long_context_llama*``.

Usage::

    python experiments/bench_long_context.py            # 1.5 minutes on 2 quiet cores, 3.5 at load 30
    python experiments/bench_long_context.py --quick    # width 32, 1 block, 32 .. 128 tokens, k = 1 and 2
    python experiments/bench_long_context.py --model llama --repeats 2
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import _harness as h
import _tables as t
import torch
from _meters import StepMeter
from hf_decoders import HFDecoderLM
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader

from lightning_parallel import PipelineStrategy
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import measure_model

KS = (1, 2, 4)
HEADS, SAMPLES, LOSS_STEPS = 4, 1, 3
GOAL = 1.8  # k = 2 fits at least this many times k = 1's longest length
FULL = dict(dim=64, depth=2, lengths=(256, 512, 1024, 2048, 4096), longer=(8192,), budget_at=1024,
            timed_at=(1024, 4096), warmup=2, timed=4)  # fmt: skip
QUICK = dict(  # (k = 1 and 2 only: a 4-rank job on the suite's 2 cores costs more than it checks)
    dim=32,
    depth=1,
    lengths=(32, 64),
    longer=(128,),
    budget_at=32,
    timed_at=(32,),
    warmup=1,
    timed=2,
    ks=(1, 2),
)


LLAMA = dict(FULL, lengths=(256, 512, 1024, 2048), longer=(), timed_at=(1024,), ks=(1, 2), model="llama")


def model(size: dict[str, Any], max_len: int) -> Any:
    torch.manual_seed(0)
    if size.get("model") == "llama":
        return LabelsLlama("llama", dim=size["dim"], depth=size["depth"], seq_len=max_len)
    return SequentialCharLM(dim=size["dim"], depth=size["depth"], heads=HEADS, seq_len=max_len)


class LabelsLlama(HFDecoderLM):
    """The Llama trained on its own loss: ``labels=`` the input ids, shifted inside the model."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss


def loader(length: int, steps: int) -> DataLoader:
    """``steps`` batches of ``SAMPLES`` windows of ``length`` bytes (the same on every rank and every k)."""
    return DataLoader(ByteWindows.of_stdlib(steps * SAMPLES, length), batch_size=SAMPLES, drop_last=True)


def fit(size: dict[str, Any], world: int, length: int, steps: int, callbacks: list) -> None:
    strategy = PipelineStrategy(pipeline_size=1, sequence_parallel_size=world, num_microbatches=1)
    trainer = h.quiet_trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=callbacks)
    trainer.fit(model(size, size["max_len"]), loader(length, steps))
    del trainer
    gc.collect()  # the last run's model and optimizer go before the next one's tracked step


def memory_worker(rank: int, world: int, size: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's MemTracker peak of the second step and its first losses, at every length."""
    out = []
    lengths = size["lengths"] + (size["longer"] if world == max(size.get("ks", KS)) else ())
    for length in lengths:
        meter, clock = StepMeter(step=1), h.StepClock()
        fit(size, world, length, LOSS_STEPS, [meter, clock])
        out.append(dict(k=world, rank=rank, seq_len=length, peak_bytes=meter.peak, losses=clock.losses))
    return out


def time_worker(rank: int, world: int, size: dict[str, Any]) -> dict[str, float]:
    """Rank 0's median step (ranks lined up around each step) at each timed length, one fit each."""
    out = {}
    for length in size["timed_at"]:
        clock = h.StepClock(barrier=True)
        fit(size, world, length, size["warmup"] + size["timed"], [clock])
        out[f"step_ms_{length}"] = clock.median_step_ms(warmup=size["warmup"])
    return out


def predicted_peaks(size: dict[str, Any], lengths: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """The planner's peak of a rank training one step, per (k, length): the same plan on ``k`` devices
    (``sequence_parallel_size=k``: what each rank holds per token divided by ``k``), the worst rank's."""
    out = {}
    for k, length in lengths:
        m = model(size, size["max_len"])
        x = torch.zeros(SAMPLES, length, dtype=torch.long)
        facts = measure_model(m, (x, x), optimizer=torch.optim.AdamW(m.parameters(), weight_decay=0.01))
        plan = ParallelPlan(
            "pipeline", devices=k, pipeline_size=1, num_microbatches=1, sequence_parallel_size=k
        )
        out[(k, length)] = max(r.peak for r in predict(facts, plan).ranks)
    return out


def longest_fitting(points: list[tuple[int, int]], budget: int, k: int) -> tuple[int, bool]:
    """The longest length whose peak fits ``budget``, linear between the measured (length, peak) around
    it, rounded down to a multiple of ``k``; and whether it is only a lower bound (every length fit)."""
    points = sorted(points)
    fitting = [(n, p) for n, p in points if p <= budget]
    if not fitting:
        return 0, False
    n0, p0 = fitting[-1]
    above = [(n, p) for n, p in points if n > n0]
    if not above:
        return n0, True
    n1, p1 = above[0]
    n = n0 + (n1 - n0) * (budget - p0) / (p1 - p0)
    return int(n) // k * k, False


def labelled_per_shard(size: dict[str, Any], k: int, length: int) -> list[int]:
    """Each shard's labelled tokens: all of them with targets made in the data (the GPT); the Llama's own
    ``labels=`` loss has no label at the sequence's last position, which the last shard holds."""
    t = length // k
    return [t] * k if size.get("model") != "llama" else [t] * (k - 1) + [t - 1]


def analyse(
    peaks: list[dict[str, Any]], predicted: dict[tuple[int, int], int], size: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The per-length rows (the worst rank's peak) and the per-k rows (longest fit, exactness)."""
    worst: dict[tuple[int, int], dict[str, Any]] = {}
    for r in peaks:
        key = (r["k"], r["seq_len"])
        worst[key] = max(worst.get(key, r), r, key=lambda x: x["peak_bytes"])
    losses: dict[tuple[int, int], list[float]] = {}
    for key in worst:  # the k shards' losses, step by step, each weighted by its labelled tokens
        ranks = sorted((r for r in peaks if (r["k"], r["seq_len"]) == key), key=lambda r: r["rank"])
        counts = labelled_per_shard(size, *key)
        steps = zip(*(r["losses"] for r in ranks))
        losses[key] = [sum(c * v for c, v in zip(counts, step)) / sum(counts) for step in steps]
    budget = math.ceil(worst[(1, size["budget_at"])]["peak_bytes"] / 2**20) * 2**20
    rows = []
    for (k, n), r in sorted(worst.items()):
        one = worst.get((1, n))
        rows.append(dict(
            k=k, seq_len=n, ranks=k, peak_bytes=r["peak_bytes"],
            peak_vs_k1=round(r["peak_bytes"] / one["peak_bytes"], 4) if one else "",
            fits=int(r["peak_bytes"] <= budget), budget_bytes=budget,
            predicted_peak_bytes=predicted.get((k, n), ""),
            predicted_vs_measured=round(predicted.get((k, n), 0) / r["peak_bytes"], 4),
            model_dim=size["dim"], model_depth=size["depth"], heads=HEADS, samples=SAMPLES,
        ))  # fmt: skip
    fits = []
    base = None
    for k in sorted({kk for kk, _ in worst}):
        measured = [(n, r["peak_bytes"]) for (kk, n), r in worst.items() if kk == k]
        longest, lower_bound = longest_fitting(measured, budget, k)
        base = base or longest
        exact_at = size["budget_at"]
        diff = max(abs(a - b) for a, b in zip(losses[(k, exact_at)], losses[(1, exact_at)]))
        fits.append(dict(
            k=k, budget_bytes=budget, longest_seq_len=longest, at_least=int(lower_bound),
            longest_vs_k1=round(longest / base, 4), goal=GOAL if k == 2 else "",
            exact_seq_len=exact_at, loss_steps=LOSS_STEPS, max_loss_diff=f"{diff:.2e}",
            first_loss=round(losses[(k, exact_at)][0], 6),
        ))  # fmt: skip
    return rows, fits


def time_rows(timing: list[dict[str, Any]], size: dict[str, Any]) -> list[dict[str, Any]]:
    """Per timed length and k: the median step and its range, per token, and the ratio to k = 1."""
    out = []
    for length in size["timed_at"]:
        for row in h.compare(timing, f"step_ms_{length}", baseline="k=1"):
            ms = [row[f"step_ms_{length}{end}"] for end in ("", "_min", "_max")]
            per_token = [round(1e3 * x / (SAMPLES * length), 3) for x in ms]
            out.append(dict(
                k=int(row["variant"][2:]), seq_len=length, repeats=row["repeats"],
                step_ms=ms[0], step_ms_min=ms[1], step_ms_max=ms[2],
                us_per_token=per_token[0], us_per_token_min=per_token[1], us_per_token_max=per_token[2],
                time_ratio=row["ratio"], time_ratio_min=row["ratio_min"], time_ratio_max=row["ratio_max"],
                warmup_steps=size["warmup"], timed_steps=size["timed"],
            ))  # fmt: skip
    return out


def plot(
    path: Any, rows: list[dict[str, Any]], fits: list[dict[str, Any]], times: list[dict[str, Any]]
) -> None:
    fig, (left, right) = h.figure(2)
    budget = rows[0]["budget_bytes"] / 2**20
    for k, f in zip([f["k"] for f in fits], fits):
        mine = [r for r in rows if r["k"] == k]
        (line,) = left.plot([r["seq_len"] for r in mine], [r["peak_bytes"] / 2**20 for r in mine], marker="o",
                            label=f"k={k} (MemTracker, worst rank)")  # fmt: skip
        left.axvline(f["longest_seq_len"], color=line.get_color(), ls=":", lw=1)
        left.annotate(f"{f['longest_seq_len']}", (f["longest_seq_len"], budget), color=line.get_color(),
                      textcoords="offset points", xytext=(3, 4), fontsize=7)  # fmt: skip
        planned = [r for r in mine if r["predicted_peak_bytes"] != ""]
        left.plot([r["seq_len"] for r in planned], [r["predicted_peak_bytes"] / 2**20 for r in planned],
                  ls="--", lw=1, color=line.get_color(), label=f"k={k}, the planner's")  # fmt: skip
    left.axhline(budget, color="tab:red", ls="--", lw=1, label=f"budget {budget:.0f} MiB (k=1's peak at "
                 f"{fits[0]['exact_seq_len']} tokens); dotted: the longest that fits")  # fmt: skip
    lengths = sorted({r["seq_len"] for r in rows})
    left.set_xscale("log", base=2)
    left.set_xticks(lengths, [str(n) for n in lengths])
    left.minorticks_off()
    left.set(
        xlabel="sequence length (tokens)",
        ylabel="peak MiB per rank",
        title="Peak of a training step per rank",
    )
    left.legend(fontsize=7, loc="upper left")
    left.grid(alpha=0.3)
    ks = [f["k"] for f in fits]
    right.bar([x - 0.2 for x in range(len(ks))], [f["longest_vs_k1"] for f in fits], 0.3, color="tab:blue",
              label="longest length that fits / k=1's")  # fmt: skip
    lengths = sorted({r["seq_len"] for r in times})
    for i, (length, marker) in enumerate(zip(lengths, "so^")):
        mine = sorted((r for r in times if r["seq_len"] == length), key=lambda r: r["k"])
        h.errorbars(right, [x + 0.05 + 0.15 * i for x in range(len(mine))], mine, "time_ratio", fmt=marker,
                    label=f"step time per token / k=1's, {length} tokens")  # fmt: skip
    right.axhline(GOAL, color="tab:red", ls="--", lw=1, label=f"goal at k=2: {GOAL}x")
    right.axhline(1, color="black", lw=0.6)
    right.set_xticks(range(len(ks)), [f"k={k}" for k in ks])
    right.set(title="Against k=1, same budget / same length")
    right.legend(fontsize=7)
    right.grid(axis="y", alpha=0.3)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def long_context_fit(rows: t.Rows) -> str:
    body = []
    for r in rows:
        longest = ("at least " if r["at_least"] == "1" else "") + r["longest_seq_len"]
        goal = ""
        if r["goal"]:
            met = float(r["longest_vs_k1"]) >= float(r["goal"])
            goal = ", meets the goal" if met else ", misses the goal"
        body.append([r["k"], t.mib(float(r["budget_bytes"])), longest, t.fixed(r["longest_vs_k1"], 2) + goal,
                     r["max_loss_diff"]])  # fmt: skip
    r0 = rows[0]
    header = [
        "k",
        "budget MiB",
        "longest length that fits",
        "vs k=1 (goal 1.8 at k=2)",
        "max loss diff vs k=1",
    ]
    return t.table(header, body) + (
        f"\n\nThe budget is k=1's MemTracker peak at {r0['exact_seq_len']} tokens, rounded up to a whole "
        "MiB; the longest length is interpolated between the measured lengths of the table below. Loss "
        f"difference: the largest over the first {r0['loss_steps']} steps' losses (the k shards', weighted "
        f"by their labelled tokens) at {r0['exact_seq_len']} tokens."
    )


def long_context_time(rows: t.Rows) -> str:
    body = []
    for r in rows:
        ratio = "-" if r["k"] == "1" else t.timed_col(r, "time_ratio", 2, t.ratio_verdict(
            r, "time_ratio", higher_is_better=False, words=("faster", "slower")))  # fmt: skip
        body.append(
            [r["seq_len"], r["k"], t.timed_col(r, "step_ms", 1), t.timed_col(r, "us_per_token", 1), ratio]
        )
    r0 = rows[0]
    header = ["tokens", "k", "step ms (rank 0)", "us per token", "time ratio vs k=1 (same repeat)"]
    return t.table(header, body) + (
        f"\n\nRank 0's median step after {r0['warmup_steps']} warm-up steps ({r0['timed_steps']} timed, the "
        f"ranks lined up around each), k=1, 2, 4 interleaved over {r0['repeats']} repeats, one spawned job "
        "each; per token: the step over the sample's tokens. k=2 and 4 are 2 and 4 processes on the 2 "
        "cores: this is what the exchanges, the gradient all-reduce over the k ranks and the extra processes "
        "cost or save here, not what k devices would gain."
    )


def long_context(rows: t.Rows) -> str:
    body = []
    for n, group in t.groups(rows, "seq_len").items():
        by_k = {r["k"]: r for r in group}
        cells = [n]
        for k in KS:
            r = by_k.get(str(k))
            over = "" if r is None or r["fits"] == "1" else " (over)"
            planned = (
                f" / {t.mib(float(r['predicted_peak_bytes']))}" if r and r["predicted_peak_bytes"] else ""
            )
            cells.append(t.mib(float(r["peak_bytes"])) + planned + over if r else "-")
        body.append(cells)
    r0 = rows[0]
    header = ["tokens", *(f"k={k}: measured / planned MiB" for k in KS)]
    return t.table(header, body) + (
        f"\n\n`SequentialCharLM` width {r0['model_dim']}, {r0['model_depth']} blocks, {r0['heads']} heads, "
        f"{r0['samples']} sample a step, AdamW; the worst rank's MemTracker peak of the second step; "
        f'"(over)": above the budget of {t.mib(float(r0["budget_bytes"]))} MiB. Byte counts: one run each, '
        "they do not depend on the load; with k > 1 a peak may differ between runs by one exchange's "
        "buffers (whether an all-to-all's copies are still alive when the peak is reached: half a MiB at "
        "k=4 and 4096 tokens, seen once)."
    )


def long_context_llama_fit(rows: t.Rows) -> str:
    return long_context_fit(rows)


def long_context_llama_time(rows: t.Rows) -> str:
    return long_context_time(rows)


def long_context_llama(rows: t.Rows) -> str:
    llama = "`LlamaForCausalLM` (`--model llama`) width"
    return long_context(rows).replace("`SequentialCharLM` width", llama)


RESULTS = t.Results(
    "long_context",
    t.Section(
        "Long context: the longest sequence within a memory budget, sequence parallelism k = 1, 2, 4",
        t.Table(long_context_fit, ("budget_bytes", "longest_seq_len", "longest_vs_k1", "max_loss_diff")),
        t.Table(long_context_time, ("step_ms", "us_per_token", "time_ratio"), timed=True),
        t.Table(long_context, ("peak_bytes", "predicted_peak_bytes")),
    ),
    t.Section(
        "Long context on a Hugging Face Llama (its own labels= loss), k = 1, 2 (--model llama)",
        t.Table(
            long_context_llama_fit, ("budget_bytes", "longest_seq_len", "longest_vs_k1", "max_loss_diff")
        ),
        t.Table(long_context_llama_time, ("step_ms", "us_per_token", "time_ratio"), timed=True),
        t.Table(long_context_llama, ("peak_bytes", "predicted_peak_bytes")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt", help="the GPT, or an HF Llama")
    args = p.parse_args(argv)
    name = "long_context" if args.model == "gpt" else f"long_context_{args.model}"
    if args.model == "gpt":  # (docs/results.md names one machine line per experiment: the GPT's run)
        h.record_machine(name, args.out_dir)
    h.quiet()
    start = time.perf_counter()
    size = dict(QUICK if args.quick else FULL) if args.model == "gpt" else dict(LLAMA)
    if args.quick and args.model == "llama":
        size.update({k: v for k, v in QUICK.items() if k != "ks"})
    size["max_len"] = max(size["lengths"] + size["longer"])
    ks = size.get("ks", KS)
    peaks = [r for k in ks for ranks in h.spawn(memory_worker, k, size) for r in ranks]
    print(f"memory: {time.perf_counter() - start:.0f} s", flush=True)
    variants = {f"k={k}": (lambda k=k: h.spawn(time_worker, k, size)[0]) for k in ks}
    timing = h.interleave(variants, repeats=args.repeats)
    print(f"timing: {time.perf_counter() - start:.0f} s", flush=True)
    predicted = predicted_peaks(size, sorted({(r["k"], r["seq_len"]) for r in peaks}))
    rows, fits = analyse(peaks, predicted, size)
    times = time_rows(timing, size)
    h.write_csv(args.out_dir / f"{name}.csv", rows)
    h.write_csv(args.out_dir / f"{name}_fit.csv", fits)
    h.write_csv(args.out_dir / f"{name}_time.csv", times)
    plot(args.out_dir / f"{name}.png", rows, fits, times)
    for f in fits:
        print(f"k={f['k']}: longest {'>=' if f['at_least'] else ''}{f['longest_seq_len']} tokens "
              f"({f['longest_vs_k1']:.2f}x k=1) within {f['budget_bytes'] / 2**20:.0f} MiB; "
              f"max loss diff {f['max_loss_diff']}")  # fmt: skip
    for r in times:
        spread = f"{r['time_ratio_min']:.2f} .. {r['time_ratio_max']:.2f}"
        print(f"k={r['k']} at {r['seq_len']} tokens: {r['us_per_token']:.1f} us/token "
              f"({r['time_ratio']:.2f}x k=1, {spread})")  # fmt: skip
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
