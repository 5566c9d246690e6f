"""Predict the peak memory of each rank for one training step: ``estimate_memory``.

The model of a step (what is alive when):

- **persistent**: parameters, the optimizer state (under 16-mixed with the GradScaler's 16 bytes),
  the gradients
  already there (DDP: the previous step's, which Lightning zeroes only after ``training_step``, so
  they live through the forward; the pipeline runs its whole schedule inside ``training_step`` and
  releases them before it, except inside an accumulation window, where it adds into them), and the
  communication buffers: DDP's gradient buckets (one gradient-sized copy; none on a single device,
  where ``Trainer(devices=1)`` runs without DDP); the pipeline's receive
  buffers (one per micro-batch for the stage input and for the gradient of its output);
- **per micro-batch in flight** (a forward done, its backward not yet): what the stage's units save
  for backward (measured, see :mod:`~lightning_parallel.planner.probe`), the stage output it keeps
  for its backward (until that micro-batch's backward, on the last stage too);
- **at a stage's first backward**: its new gradients; during any backward a transient of gradient
  tensors (twice the stage's largest saved tensor plus its output, a documented approximation);
- **the optimizer step**: parameters + gradients + state, plus a gradient-sized flat buffer for
  the replicas' all-reduce.
- **the techniques** (``Technique.memory``, folded over a
  :class:`~lightning_parallel.techniques.ledgers.MemoryLedger` per rank in the list's order, before
  the walk): each moves the bytes it changes between the columns (FSDP2 keeps a shard of the
  parameters and of the state and gathers the stage for the step, ZeRO-1 a share of the state, offload
  moves state or activations to the host, ...), and may leave a note for the table (compile). What one
  micro-batch costs a stage is theirs too, before (``Technique.stage_costs``: with recomputation a
  unit keeps only its input, and one unit at a time is recomputed in backward; see
  :mod:`~lightning_parallel.planner.stage_costs`).

The micro-batches in flight come from walking torch's own schedule order (plain data, see
:mod:`~lightning_parallel.planner.schedule`); the peak is the largest total over that walk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_parallel._table import format_bytes, format_table
from lightning_parallel.layout.choices import placement
from lightning_parallel.pipeline.plan import stage_rank
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.facts import ModelFacts, measure_model
from lightning_parallel.planner.precision import LOSS_SCALER_BYTES
from lightning_parallel.planner.probe import BEFORE, StepFn, default_step
from lightning_parallel.planner.resolve import resolve
from lightning_parallel.planner.schedule import Action, peak_in_flight, rank_actions
from lightning_parallel.planner.stage_costs import StageCosts, stage_costs
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.ledgers import DEVICE_COLUMNS, MemoryLedger

COMPONENTS = DEVICE_COLUMNS[:5]
"""The columns of every table; ``gathered`` (FSDP2's unsharded stage) only where a rank has some."""
GATHERED = DEVICE_COLUMNS[5]


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted peak, split into what is alive at that moment.

    ``activations`` includes the backward transient; ``buffers``: communication buffers and kept outputs;
    ``gathered``: an FSDP2 stage's all-gathered parameters (``parameters`` is then the rank's shard).
    ``peak`` is the device's; ``host``: what the plan keeps in host memory for this rank (offload), apart
    from it; ``disk``: what it keeps on disk.

    Example::

        rank = predict(facts, plan).worst
        rank.peak, rank.host          # bytes on its device, bytes in its host memory
    """

    rank: int
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    in_flight: tuple[int, ...]
    gathered: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        """Device and host together (one memory on a machine without an accelerator)."""
        return self.peak + self.host

    @property
    def peak(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.buffers
            + self.gathered
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """The prediction for each pipeline rank of a configuration (the replicas of a stage are alike).

    Example::

        est = estimate_memory(model, batch, devices=4, strategy=PipelineStrategy(pipeline_size=2))
        print(est.format_table()); est.peak       # bytes on the fullest rank
    """

    plan: ParallelPlan
    ranks: tuple[RankMemory, ...]
    notes: tuple[str, ...] = ()  # printed under the table (the techniques' notes)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak(self) -> int:
        return self.worst.peak

    @property
    def host(self) -> int:
        """The most host bytes any one rank's offload keeps."""
        return max((r.host for r in self.ranks), default=0)

    @property
    def disk(self) -> int:
        """The most bytes any one rank keeps on disk."""
        return max((r.disk for r in self.ranks), default=0)

    def format_table(self) -> str:
        components = [*COMPONENTS, *([GATHERED] if any(r.gathered for r in self.ranks) else [])]
        apart = [c for c in ("host", "disk") if any(getattr(r, c) for r in self.ranks)]
        headers = [
            "rank",
            "stages",
            "in flight",
            *components,
            "peak" + (" (device)" if apart else ""),
            *apart,
        ]
        rows = [
            [str(r.rank), ",".join(map(str, r.stages)), ",".join(map(str, r.in_flight)),
             *(format_bytes(getattr(r, c)) for c in components), format_bytes(r.peak),
             *(format_bytes(getattr(r, c)) for c in apart)]
            for r in self.ranks
        ]  # fmt: skip
        table = f"{self.plan.label()} ({self.plan.precision})\n" + format_table(headers, rows, align=">")
        return table + "".join(f"\n{note}" for note in self.notes)


def estimate_memory(
    module: nn.Module,
    batch: Any,
    devices: int = 1,
    strategy: Any = "auto",
    precision: str = "32-true",
    optimizer: torch.optim.Optimizer | None = None,
    step: StepFn = default_step,
    accumulate_grad_batches: int = 1,
) -> MemoryEstimate:
    """Predict the peak bytes of each rank for one training step of ``module`` on ``batch``.

    Args:
        module: the LightningModule (or any ``nn.Module``); on the meta device its activations are
            measured on fake tensors of this machine's accelerator (else the CPU): nothing is
            allocated, and the forward takes that device's path (run it where the job runs).
        batch: one batch as one rank's dataloader yields it (per replica for a pipeline).
        devices: ranks in all.
        strategy: ``"auto"`` (what ``Trainer(devices=devices)`` runs: one device without DDP, several
            with DDP), ``"single_device"``, ``"ddp"``, ``"pipeline"``, a ``PipelineStrategy`` or a
            :class:`ParallelPlan`. The table's first line names the one modelled.
        precision: as the Trainer's (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).
        optimizer: the optimizer(s), when ``configure_optimizers`` cannot run without a Trainer.
        step: ``step(module, batch)`` runs one training forward (default: ``training_step(batch, 0)``).
        accumulate_grad_batches: as the Trainer's; above 1 a pipeline rank holds a full gradient
            through the schedule (the window's, added into).

    Raises:
        ValueError: a bad strategy, precision or stage count, or a batch the model rejects.

    Example::

        est = estimate_memory(LM(), (x, y), devices=4, precision="bf16-mixed",
                              strategy=PipelineStrategy(pipeline_size=4, num_microbatches=8))
        print(est.format_table())
    """
    config = replace(resolve(strategy, devices, precision), accumulate_grad_batches=accumulate_grad_batches)
    tp = config.tensor_parallel_size
    return predict(measure_model(module, batch, precision, optimizer, step, tensor_parallel_size=tp), config)


def predict(facts: ModelFacts, config: ParallelPlan, samples: int | None = None) -> MemoryEstimate:
    """The estimate for ``config`` from measured :class:`ModelFacts` (cheap: no forward pass).

    ``samples``: the batch one rank (one replica) gets, if not the measured batch's size.

    Example::

        facts = measure_model(model, batch)
        [predict(facts, c).peak for c in configs]
    """
    if config.precision is None:  # (the plan leaves it to the Trainer: the measured one)
        config = replace(config, precision=facts.precision)
    if config.precision != facts.precision:
        raise ValueError(
            f"the facts were measured in {facts.precision!r} but the config asks {config.precision!r}: "
            f"measure again with precision={config.precision!r}"
        )
    if config.strategy != "pipeline":
        buckets = config.strategy == "ddp"
        return MemoryEstimate(config, (_whole_model_rank(facts, samples or facts.samples, buckets),))
    if facts.tensor_parallel_size != config.tensor_parallel_size:
        raise ValueError(
            f"the facts were measured for tensor_parallel_size={facts.tensor_parallel_size} but the config "
            f"asks {config.tensor_parallel_size}: measure_model(..., tensor_parallel_size="
            f"{config.tensor_parallel_size})"
        )
    costs = stage_costs(facts, config, samples)
    ledgers = [_pipeline_rank(facts, costs, config, r) for r in range(config.pipeline_size)]
    notes = dict.fromkeys(note for _, ledger in ledgers for note in ledger.notes)
    return MemoryEstimate(config, tuple(rank for rank, _ in ledgers), tuple(notes))


def _whole_model_rank(facts: ModelFacts, n: int, buckets: bool) -> RankMemory:
    keys = list(facts.tensors)
    params = sum(facts.tensors[k].nbytes for k in keys)
    grads = sum(facts.tensors[k].grad for k in keys)
    state = facts.state_of(keys) + LOSS_SCALER_BYTES.get(facts.precision, 0)
    acts = sum(u.saved.at(n) + u.after.at(n) + u.weight_copies for u in facts.probe.units.values())
    largest = max((u.largest.at(n) for u in facts.probe.units.values()), default=0)
    # Forward end: the previous gradients are still alive (zeroed after training_step), and under DDP
    # its gradient buckets (a gradient-sized copy: gradient_as_bucket_view=False, Lightning's default).
    return RankMemory(0, (0,), params, grads, state, acts + 2 * largest, grads if buckets else 0, (1,))


def _pipeline_rank(
    facts: ModelFacts, costs: list[StageCosts], config: ParallelPlan, rank: int
) -> tuple[RankMemory, MemoryLedger]:
    """One rank's peak: its stages as plain replicas hold them, each technique's moves (the ledger, in the
    list's order), then the walk of its schedule; and the ledger (its notes)."""
    style, num_stages = placement(config.schedule), len(costs)
    local = [c for c in costs if stage_rank(c.index, config.pipeline_size, num_stages, style) == rank]
    params = list(dict.fromkeys(k for c in local for k in c.param_keys))  # a tied weight once per rank
    g_bytes = sum(facts.tensors[k].grad for k in params)
    actions = rank_actions(
        config.schedule, config.pipeline_size, config.stages_per_rank, config.num_microbatches
    )
    ledger = MemoryLedger(config, facts, rank, local, params, peak_in_flight(actions[rank]),
                          reduced_gradients=g_bytes)  # fmt: skip
    ledger.device.update(
        parameters=sum(facts.tensors[k].nbytes for k in params),
        gradients=g_bytes,
        # The optimizer state of every parameter, and the loss scaler's, which every rank holds.
        optimizer=facts.state_of(params) + LOSS_SCALER_BYTES.get(config.precision, 0),
        buffers=sum(c.recv_buffers for c in local),
    )
    ledger.whole = dict(ledger.device)
    for technique in TECHNIQUES:
        technique.memory(ledger)
    # The previous step's gradients are released before the schedule (Lightning zeroes them after
    # training_step anyway): the new ones grow during backward. Inside an accumulation window the
    # schedule adds into the window's gradients, which are there from the start.
    accumulating = config.accumulate_grad_batches > 1
    device = ledger.device
    walk = _walk(
        actions[rank], {c.index: c for c in ledger.stages}, 0 if accumulating else device["gradients"]
    )
    memory = RankMemory(
        rank,
        tuple(c.index for c in local),
        device["parameters"],
        device["gradients"] if accumulating else walk.new_grads,
        device["optimizer"],
        walk.activations,
        device["buffers"] + walk.kept,
        tuple(ledger.in_flight.get(c.index, 0) for c in local),
        device["gathered"],
        sum(ledger.host.values()),
        sum(ledger.disk.values()),
    )
    return memory, ledger


@dataclass
class _Walk:
    activations: int = 0
    kept: int = 0
    new_grads: int = 0


def _walk(actions: list[Action], stages: dict[int, StageCosts], all_grads: int) -> _Walk:
    """Walk the rank's actions; return the components at the moment of the largest total.

    A stage's first backward frees its micro-batch's activations while its gradients appear, so
    its peak is either just before (no new gradients yet) or just after (that micro-batch freed).
    """
    live = kept = grads = 0
    started: set[int] = set()
    backward_seen: set[int] = set()
    best = _Walk()

    def consider(activations: int, kept_now: int, grads_now: int) -> None:
        nonlocal best
        now = _Walk(activations, kept_now, min(grads_now, all_grads))
        if now.activations + now.kept + now.new_grads > best.activations + best.kept + best.new_grads:
            best = now

    for a in actions:
        c = stages[a.stage]
        if a.kind == "F":
            if a.stage not in started:
                started.add(a.stage)
                live += c.weight_copies
            live += c.per_microbatch
            kept += c.kept_output
            consider(live + c.forward_transient, kept, grads)
            continue
        consider(live + c.backward_transient, kept, grads)
        if a.stage not in backward_seen:
            backward_seen.add(a.stage)
            grads += c.grads
            consider(live - c.per_microbatch + c.backward_transient, kept, grads)
        if a.kind in ("B", "W"):
            live -= c.per_microbatch
            kept -= c.kept_output
    return best


__all__ = ["BEFORE", "MemoryEstimate", "RankMemory", "estimate_memory", "format_bytes", "predict"]
