"""Tensor parallelism against data parallelism inside a pipeline: pp 2 x tp 2 against pp 2 x dp 2.

The same 4 processes, the same model and global batch: ``PipelineStrategy(pipeline_size=2,
tensor_parallel_size=2)`` (each stage's attention and MLP weights split over 2 ranks, one replica
running the whole global batch) against ``PipelineStrategy(pipeline_size=2)`` (2 replicas of each stage,
half the global batch each). Per rank:

- **parameters + gradients + optimizer state**: bytes of the local tensors (a DTensor's local slice)
  held at ``on_before_optimizer_step`` of the second and later steps (AdamW's state exists by then);
  tensor parallelism divides the split weights' share by 2, replicas divide nothing;
- **step time**: the wall time of each training step after the first (median and min-max over the
  steps). On 2 CPU cores the 4 processes share the cores: the timings say what tensor parallelism
  costs in collectives (two all-reduces per block forward and backward, gloo on CPU) against
  replicas (one gradient all-reduce per step), not what a GPU node would show.

Two models, each against its own pp 2 x dp 2 baseline: ``models.SequentialCharLM(split_qkv=True)``
(separate q, k, v: what the default plan splits; the Sequential path, whose stage modules run on local
slices) and a Hugging Face Llama from config (``hf_decoders.HFDecoderLM``, split with its own
``base_model_tp_plan`` on the traced path, whose stage graphs run on DTensors: the dispatch of every
op through DTensor's sharding propagation is part of what its step time shows). Width 256, 4 blocks,
AdamW. Byte counts do not depend on the load (one run); the timings do. Writes ``tensor_parallel.csv``
and ``tensor_parallel.png`` under ``--out-dir``.

Usage::

    python experiments/bench_tensor_parallel.py            # ~3 minutes on 2 cores
    python experiments/bench_tensor_parallel.py --quick    # the Sequential model, width 32, 2 blocks, 2 steps
"""

from __future__ import annotations

import time
from typing import Any

import _harness as h
import _tables as t
import torch
from models import SequentialCharLM
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_parallel import PipelineStrategy

SHAPES = {"pp 2 x dp 2": dict(pipeline_size=2), "pp 2 x tp 2": dict(pipeline_size=2, tensor_parallel_size=2)}
MODELS = ("Sequential", "HF Llama (traced)")
RUNS = [f"{model}: {shape}" for model in MODELS for shape in SHAPES]
SIZE = dict(dim=256, depth=4, seq_len=64, global_batch=16, steps=6)
# --quick: checks that it runs, on the Sequential model only (the suite's tensor-parallel job trains a
# Hugging Face Llama at pp 2 x tp 2: tests/test_pipeline_tensor.py)
QUICK_SIZE = dict(dim=32, depth=2, seq_len=16, global_batch=8, steps=2)


def build(model: str, size: dict[str, int]) -> Any:
    torch.manual_seed(0)
    dim, depth, seq_len = size["dim"], size["depth"], size["seq_len"]
    if model == "Sequential":
        return SequentialCharLM(dim=dim, depth=depth, seq_len=seq_len, split_qkv=True)
    from hf_decoders import HFDecoderLM

    return HFDecoderLM("llama", dim=dim, depth=depth, seq_len=seq_len)


def local_bytes(tensors: Any) -> int:
    """Bytes of the local data behind ``tensors`` (a DTensor counts its slice)."""
    total = 0
    for x in tensors:
        if torch.is_tensor(x):
            x = x.to_local() if hasattr(x, "to_local") else x
            total += x.numel() * x.element_size()
    return total


class Probe(h.StepClock):
    """Parameter, gradient and optimizer bytes before the optimizer steps, and each step's wall time
    (between barriers: the ranks' step)."""

    def __init__(self) -> None:
        super().__init__(barrier=True)
        self.ppo = 0

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:
            return
        params = list(pl_module.parameters())
        state = [v for s in optimizer.state.values() for v in s.values()]
        self.ppo = local_bytes(params) + local_bytes(p.grad for p in params) + local_bytes(state)


def worker(rank: int, world: int, size: dict[str, int], runs: list[str]) -> list[dict[str, Any]]:
    records = []
    g = torch.Generator().manual_seed(0)
    global_batch, steps = size["global_batch"], size["steps"]
    x = torch.randint(0, 256, (global_batch * steps, size["seq_len"] + 1), generator=g)
    data = TensorDataset(x[:, :-1], x[:, 1:])
    for name in runs:
        model, shape = name.split(": ")
        kwargs = SHAPES[shape]
        probe = Probe()
        strategy = PipelineStrategy(num_microbatches=4, **kwargs)
        trainer = h.quiet_trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[probe])
        replicas = world // (2 * kwargs.get("tensor_parallel_size", 1))
        trainer.fit(build(model, size), DataLoader(data, batch_size=global_batch // replicas))
        times = probe.step_seconds(1)  # the first step builds the schedule and the optimizer state
        s = h.spread(times)
        records.append(
            dict(run=name, model=model, shape=shape, rank=rank, world_size=world, model_dim=size["dim"],
                 model_depth=size["depth"], global_batch=global_batch, ppo_bytes=probe.ppo, step_s=s.median,
                 step_s_min=s.lo, step_s_max=s.hi, steps_timed=len(times))
        )  # fmt: skip
    return records


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    fig, (ax1, ax2) = h.figure(ncols=2, size=(11, 5))
    for offset, name in enumerate(RUNS):
        mine = [r for r in rows if r["run"] == name]
        xs = [r["rank"] + 0.2 * (offset - 1.5) for r in mine]
        ax1.bar(xs, [r["ppo_bytes"] / 2**20 for r in mine], width=0.2, label=name)
        low = [r["step_s"] - r["step_s_min"] for r in mine]
        high = [r["step_s_max"] - r["step_s"] for r in mine]
        ax2.errorbar(
            [r["rank"] for r in mine],
            [r["step_s"] for r in mine],
            yerr=[low, high],
            fmt="o-",
            capsize=3,
            label=name,
        )
    ax1.set(xlabel="rank", ylabel="MiB", title="parameters + gradients + AdamW state per rank")
    ax2.set(xlabel="rank", ylabel="s", title="step time (median, min-max over steps)")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({r["rank"] for r in rows}))
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
        ax.grid(alpha=0.3)
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def tensor_parallel(rows: t.Rows) -> str:
    body = [
        [r["run"], r["rank"], t.mib(float(r["ppo_bytes"])), t.fixed(r["ppo_vs_dp"], 2),
         t.timed_col(r, "step_s", 3), t.fixed(r["step_vs_dp"], 2)]
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
    return t.table(header, body) + "\n\n" + note


RESULTS = t.Results(
    "tensor_parallel",
    t.Section(
        "Tensor parallelism inside the stages: pp 2 x tp 2 against pp 2 x dp 2",
        t.Table(
            tensor_parallel, ("ppo_bytes", "ppo_vs_dp", "step_s", "step_s_min", "step_s_max", "step_vs_dp")
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> int:
    args = h.parser(__doc__, repeats=None).parse_args(argv)
    h.record_machine("tensor_parallel", args.out_dir)
    h.quiet()
    start = time.perf_counter()
    runs = [r for r in RUNS if r.startswith("Sequential")] if args.quick else RUNS
    rows = [r for records in h.spawn(worker, 4, QUICK_SIZE if args.quick else SIZE, runs) for r in records]
    rows.sort(key=lambda r: (RUNS.index(r["run"]), r["rank"]))
    base = {(r["model"], r["rank"]): r for r in rows if r["shape"] == "pp 2 x dp 2"}
    for r in rows:  # each model against its own replicas
        r["ppo_vs_dp"] = round(r["ppo_bytes"] / base[r["model"], r["rank"]]["ppo_bytes"], 4)
        r["step_vs_dp"] = round(r["step_s"] / base[r["model"], r["rank"]]["step_s"], 4)
    h.write_csv(args.out_dir / "tensor_parallel.csv", rows)
    plot(args.out_dir / "tensor_parallel.png", rows)
    for r in rows:
        print(f"{r['run']:<32} rank {r['rank']}: {r['ppo_bytes'] / 2**20:7.2f} MiB ({r['ppo_vs_dp']:.2f}x), "
              f"step {r['step_s']:.3f} s ({r['step_vs_dp']:.2f}x)")  # fmt: skip
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
