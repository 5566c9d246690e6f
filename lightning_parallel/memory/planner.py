"""Which configurations fit a memory budget on N devices, and which of those is fastest.

Every candidate (DDP, and each pipeline shape x schedule x micro-batches x recomputation x sharded
optimizer state) is sized by :func:`~lightning_parallel.memory.estimate.predict` from one measurement
of the model. They are ranked by a simple cost model, the estimated step time relative to perfect
scaling (1.0 = N devices each doing 1/N of the work, no waiting):

    time = imbalance / (1 - bubble) x (1 + recompute / 3) x (1 + 0.01 (v m - 1)) x (1.02 if sharded)

- ``bubble`` = (p - 1) / (v m + p - 1): the idle share of a pipeline of p ranks, m micro-batches,
  v stages per rank (0 for DDP);
- ``imbalance`` = the slowest stage's work / the mean stage's work, work measured by the bytes a
  stage saves per micro-batch (a proxy for its FLOPs; 1 for DDP);
- ``recompute``: the share of that work whose forward runs twice (a forward is ~1/3 of forward +
  backward);
- each micro-batch beyond the first costs 1% (Python and kernel launches per micro-batch and stage;
  ``bench_pipeline.py`` measured about 1.5% per micro-batch for one process on CPU);
- a sharded optimizer state broadcasts each updated parameter once per step: a flat 2%; FSDP2 stages
  (their parameters, gradients and optimizer state sharded) all-gather each stage once per step and
  reduce-scatter its gradients: a flat 3%;
- tensor parallelism over t ranks all-reduces each block's activations twice per direction, on the
  critical path: a flat 10% (a guess for fast links within a node; ``bench_tensor_parallel.py`` measured
  1.7-1.9x the step on 2 CPU cores with gloo, where nothing is fast).

Ties go to DDP (Lightning's own strategy, whose all-reduce overlaps the backward), then to the
smaller peak. Communication (DDP's all-reduce of every gradient against a pipeline's activations) is
not modelled; the ranking is a first guess to try, the memory column is the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel._table import format_table
from lightning_parallel.memory.estimate import MemoryEstimate, format_bytes, predict
from lightning_parallel.memory.facts import ModelFacts
from lightning_parallel.memory.stage_costs import stage_costs
from lightning_parallel.plan.parallel_plan import ParallelPlan

SEARCHED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""The schedules the search tries (the zero-bubble ones are run by hand: their memory is modelled too)."""


@dataclass(frozen=True)
class Candidate:
    """One sized configuration: its estimate, the per-replica batch, and the cost model's time."""

    plan: ParallelPlan
    estimate: MemoryEstimate
    batch: int
    time: float
    bubble: float

    @property
    def peak(self) -> int:
        return self.estimate.peak


def candidate_plans(
    devices: int,
    num_blocks: int,
    global_batch: int,
    precision: str = "32-true",
    pipeline_sizes: list[int] | None = None,
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES,
    fsdp: bool = False,
    tensor_parallel_size: int = 1,
) -> list[ParallelPlan]:
    """DDP and every pipeline shape the model and batch allow, with and without each memory option.

    Micro-batches m in {p, 2p, 4p} (1, 2, 4 for p = 1) that divide the per-replica batch. With
    several replicas, the stages' data parallelism: plain replicas, ZeRO-1, and with ``fsdp`` (a
    model split as an ``nn.Sequential``, whose stages FSDP2 can shard) FSDP2 over all replicas. With
    ``tensor_parallel_size`` t > 1, pipelines of ``devices / t`` ranks whose stages are split over t
    (no DDP, no ZeRO-1: it does not take split weights).

    Raises:
        ValueError: a requested pipeline size does not divide ``devices`` or exceeds the blocks.

    Example::

        candidate_plans(devices=4, num_blocks=10, global_batch=32)
    """
    tp = tensor_parallel_size
    if tp < 1 or devices % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the devices ({devices})")
    ranks = devices // tp  # the pipeline x data-parallel ranks of one tensor-parallel coordinate
    sizes = pipeline_sizes or [p for p in range(1, ranks + 1) if ranks % p == 0]
    if pipeline_sizes and tp > 1:
        sizes = [p for p in sizes if ranks % p == 0]  # the others are tried at tp = 1
    for p in sizes:
        if ranks % p or p > num_blocks:
            raise ValueError(
                f"pipeline size {p} does not fit: it must divide the devices ({devices}) and be at most "
                f"the number of blocks ({num_blocks})"
            )
    whole = "single_device" if devices == 1 else "ddp"
    ddp = global_batch % devices == 0 and tp == 1
    out = [ParallelPlan(whole, devices, precision=precision)] if ddp else []
    for p in sizes:
        dp = ranks // p
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        for schedule, v in _schedules(p, num_blocks, schedules):
            for m in _microbatches(p, per_replica):
                for ac in (False, True):
                    modes = ("replicate", *(["zero1"] if tp == 1 else []), *(["fsdp"] if fsdp else []))
                    for mode in modes if dp > 1 else ("replicate",):
                        out.append(
                            ParallelPlan(
                                "pipeline", devices, p, m, schedule, v, activation_checkpointing=ac,
                                precision=precision, data_parallel=mode, tensor_parallel_size=tp,
                            )
                        )  # fmt: skip
    return out


def rank_plans(facts: ModelFacts, configs: list[ParallelPlan], global_batch: int) -> list[Candidate]:
    """Size and rank ``configs`` (fastest first by the cost model).

    Example::

        ranked = rank_plans(measure_model(model, batch), candidate_plans(4, 10, 32), 32)
    """
    out = []
    for config in configs:
        batch = global_batch // config.data_parallel_size
        estimate = predict(facts, config, samples=batch)
        bubble, time = _time(facts, config, batch)
        out.append(Candidate(config, estimate, batch, time, bubble))
    return ranked(out)


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first by the cost model; ties to DDP, then to the smaller peak (several plans merged)."""
    return sorted(candidates, key=lambda c: (round(c.time, 6), c.plan.strategy == "pipeline", c.peak))


def fastest_fit(candidates: list[Candidate], budget: int) -> Candidate | None:
    """The first (fastest) candidate whose worst rank fits ``budget`` bytes, or None."""
    return next((c for c in candidates if c.peak <= budget), None)


def format_plan(candidates: list[Candidate], budget: int) -> str:
    """The table: one row per candidate, ``fits`` against ``budget``, the fastest fit marked ``<-``."""
    best = fastest_fit(candidates, budget)
    headers = [
        "configuration",
        "batch/replica",
        "micro-batch",
        "peak (worst rank)",
        "fits",
        "bubble",
        "est. time",
        "",
    ]
    rows = []
    for c in candidates:
        mb = c.batch // c.plan.num_microbatches if c.plan.strategy == "pipeline" else c.batch
        fits = "yes" if c.peak <= budget else "no"
        mark = "<- fastest that fits" if c is best else ""
        rows.append([c.plan.label(), str(c.batch), str(mb), format_bytes(c.peak), fits, f"{c.bubble:.2f}",
                     f"{c.time:.2f}", mark])  # fmt: skip
    return format_table(headers, rows)


def _schedules(p: int, num_blocks: int, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    if p == 1:
        return [("1f1b", 1)]
    out = [(s, 1) for s in schedules if s in ("gpipe", "1f1b")]
    if "interleaved_1f1b" in schedules and 2 * p <= num_blocks:
        out.append(("interleaved_1f1b", 2))
    return out


def _microbatches(p: int, per_replica: int) -> list[int]:
    wanted = (1, 2, 4) if p == 1 else (p, 2 * p, 4 * p)
    return [m for m in wanted if m <= per_replica and per_replica % m == 0]


def _time(facts: ModelFacts, config: ParallelPlan, batch: int) -> tuple[float, float]:
    if config.strategy != "pipeline":
        return 0.0, 1.0
    p, v, m = config.pipeline_size, config.stages_per_rank, config.num_microbatches
    bubble = (p - 1) / (v * m + p - 1)
    costs = stage_costs(facts, config, samples=batch)
    work = [c.work for c in costs]
    per_rank = [sum(w for c, w in zip(costs, work) if c.index % p == r) for r in range(p)]
    imbalance = max(per_rank) / (sum(per_rank) / p) if sum(per_rank) else 1.0
    recomputed = sum(c.recomputed_work for c in costs) / max(sum(work), 1)
    overhead = 1 + 0.01 * (v * m - 1)
    time = imbalance / (1 - bubble) * (1 + recomputed / 3) * overhead
    time *= {"zero1": 1.02, "fsdp": 1.03}.get(config.data_parallel, 1.0)
    time *= 1.10 if config.tensor_parallel_size > 1 else 1.0
    return bubble, time
