"""Per pipeline stage: its parameters and the bytes one micro-batch costs it, from the measured units.

A plain stage's costs, then each technique's change of them (``Technique.stage_costs``, folded over a
:class:`~lightning_parallel.techniques.ledgers.CostLedger` in the list's order: recomputation keeps
only the inputs of the units it recomputes): what the memory estimate and the time model both read.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.facts import ModelFacts
from lightning_parallel.planner.probe import BEFORE
from lightning_parallel.planner.units import NOT_SPLIT, WHOLE, Unit, UnitLayout, partition
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.ledgers import CostLedger


@dataclass
class StageCosts:
    """One stage's memory facts for one micro-batch of the configured size.

    ``per_microbatch``: saved for backward while the micro-batch is in flight; ``kept_output``: the
    stage output kept until its backward (the last stage's too: a training step does not ask the
    schedule for the merged outputs); ``recv_buffers``:
    the receive buffers torch allocates for every micro-batch; transients: peaks on top during one pass.
    """

    index: int
    units: list[str]
    param_keys: list[int]
    grads: int
    per_microbatch: int
    kept_output: int
    weight_copies: int
    forward_transient: int
    backward_transient: int
    recv_buffers: int


def stage_costs(facts: ModelFacts, config: ParallelPlan, samples: int | None = None) -> list[StageCosts]:
    """The costs of every stage of ``config``'s pipeline, for ``samples`` per replica (default: the batch's).

    Raises:
        ValueError: more stages than the model has blocks (with the counts), or bad unit names.

    Example::

        costs = stage_costs(measure_model(model, batch), ParallelPlan("pipeline", 2, 2, 4))
    """
    n_stages = config.num_stages
    _check_stages(facts.layout, config)
    counts = partition(facts.layout, n_stages, config.partition)
    per_stage = facts.layout.stage_units(counts)
    mb = (samples or facts.samples) / config.num_microbatches
    ledger = CostLedger(
        config, facts, mb, [_one(facts, s, units, mb, config) for s, units in enumerate(per_stage)]
    )
    for technique in TECHNIQUES:
        technique.stage_costs(ledger)
    return ledger.stages


def _check_stages(layout: UnitLayout, config: ParallelPlan) -> None:
    """The model has at least as many blocks as ``config`` has stages (one, for a model run whole)."""
    n_stages = config.num_stages
    if n_stages <= layout.max_stages:
        return
    stages = (
        f"{n_stages} pipeline stages (pipeline_size {config.pipeline_size} x stages_per_rank "
        f"{config.stages_per_rank})"
    )
    if layout.kind == WHOLE:
        raise ValueError(
            f"{stages} but the model has no pipeline units ({NOT_SPLIT}): use pipeline_size=1, or hold "
            f"its layers in a top-level nn.Sequential (or its blocks in an nn.ModuleList) to split it"
        )
    raise ValueError(
        f"{stages} but the model has {layout.max_stages} "
        f"{'layers' if layout.kind == 'sequential' else 'blocks'} in `{layout.container}`: "
        f"use at most {layout.max_stages} stages"
    )


def _one(facts: ModelFacts, index: int, units: list[Unit], mb: float, config: ParallelPlan) -> StageCosts:
    n_stages, m = config.num_stages, config.num_microbatches
    first, last = index == 0, index == n_stages - 1
    acts = [facts.probe.unit(u.name) for u in units]
    keys = list(dict.fromkeys(k for u in units for k in facts.unit_params[u.name]))
    if first:
        keys += [k for k in facts.loose_params if k not in keys]
    # Each unit keeps what it saved for backward, and what the code after it saved (a residual add); a
    # later stage's first unit does not keep its input twice: the receive buffer holds it.
    held = 0
    for i, a in enumerate(acts):
        kept = a.saved.at(mb)
        if i == 0 and not first:
            kept -= a.saved_input.at(mb)
        held += kept + a.after.at(mb)
    kept_input = facts.probe.unit(BEFORE).saved.at(mb) if first else 0
    out = acts[-1].outputs.at(mb)
    kept = max(0, out - acts[-1].saved_output.at(mb)) if not last else out
    largest = max((a.largest.at(mb) for a in acts), default=0)
    return StageCosts(
        index=index,
        units=[u.name for u in units],
        param_keys=keys,
        grads=sum(facts.tensors[k].grad for k in keys),
        per_microbatch=held + kept_input,
        kept_output=kept,
        weight_copies=sum(a.weight_copies for a in acts),
        forward_transient=largest,
        backward_transient=2 * largest + out,
        recv_buffers=m * ((0 if first else acts[0].inputs.at(mb)) + (0 if last else out)),
    )
