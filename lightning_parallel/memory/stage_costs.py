"""Per pipeline stage: its parameters and the bytes one micro-batch costs it, from the measured units."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.memory.facts import ModelFacts
from lightning_parallel.memory.probe import BEFORE, UnitActivations
from lightning_parallel.memory.units import Unit, partition
from lightning_parallel.parallelize.recompute import select_units
from lightning_parallel.plan.parallel_plan import ParallelPlan


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
    work: int  # bytes its units save per micro-batch, a proxy for its compute (the planner's)
    recomputed_work: int


def stage_costs(facts: ModelFacts, config: ParallelPlan, samples: int | None = None) -> list[StageCosts]:
    """The costs of every stage of ``config``'s pipeline, for ``samples`` per replica (default: the batch's).

    Raises:
        ValueError: more stages than the model has blocks (with the counts), or bad unit names.

    Example::

        costs = stage_costs(measure_model(model, batch), ParallelPlan("pipeline", 2, 2, 4))
    """
    n_stages = config.num_stages
    blocks = facts.layout.blocks()
    if n_stages > len(blocks):
        raise ValueError(
            f"{n_stages} pipeline stages (pipeline_size {config.pipeline_size} x stages_per_rank "
            f"{config.stages_per_rank}) but the model has {len(blocks)} "
            f"{'layers' if facts.layout.kind == 'sequential' else 'blocks'} in `{facts.layout.container}`: "
            f"use at most {len(blocks)} stages"
        )
    counts = partition(facts.layout, n_stages, config.partition)
    per_stage = facts.layout.stage_units(counts)
    chosen = set(_recomputed(facts, config))
    mb = (samples or facts.samples) / config.num_microbatches
    return [_one(facts, s, units, chosen, mb, config) for s, units in enumerate(per_stage)]


def _recomputed(facts: ModelFacts, config: ParallelPlan) -> list[str]:
    select = config.activation_checkpointing
    if isinstance(select, tuple):
        select = list(select)
    units = [(u.name, u.module) for u in facts.layout.units]
    if facts.layout.kind == "blocks" and select is True:
        units = [(u.name, u.module) for u in facts.layout.blocks()]  # the blocks, not embeddings/head
    return select_units(units, select)


def _one(
    facts: ModelFacts, index: int, units: list[Unit], recomputed: set[str], mb: float, config: ParallelPlan
) -> StageCosts:
    n_stages, m = config.num_stages, config.num_microbatches
    first, last = index == 0, index == n_stages - 1
    acts = [facts.probe.unit(u.name) for u in units]
    keys = list(dict.fromkeys(k for u in units for k in facts.unit_params[u.name]))
    if first:
        keys += [k for k in facts.loose_params if k not in keys]
    held = _held(units, acts, recomputed, mb, first)
    if first:
        held += facts.probe.unit(BEFORE).saved.at(mb)
    out = acts[-1].outputs.at(mb)
    kept = max(0, out - acts[-1].saved_output.at(mb)) if not last else out
    largest = max((a.largest.at(mb) for a in acts), default=0)
    recomputed_saved = [a.saved.at(mb) for u, a in zip(units, acts) if u.name in recomputed]
    recompute_peak, recompute_work = max(recomputed_saved, default=0), sum(recomputed_saved)
    return StageCosts(
        index=index,
        units=[u.name for u in units],
        param_keys=keys,
        grads=sum(facts.tensors[k].grad for k in keys),
        per_microbatch=held,
        kept_output=kept,
        weight_copies=sum(a.weight_copies for a in acts),
        forward_transient=largest,
        backward_transient=recompute_peak + 2 * largest + out,
        recv_buffers=m * ((0 if first else acts[0].inputs.at(mb)) + (0 if last else out)),
        work=sum(a.saved.at(mb) for a in acts),
        recomputed_work=recompute_work,
    )


def _held(
    units: list[Unit], acts: list[UnitActivations], recomputed: set[str], mb: float, first: bool
) -> int:
    """Bytes one micro-batch keeps in the stage until its backward (see the module docstring of estimate)."""
    total = 0
    for i, (unit, a) in enumerate(zip(units, acts)):
        prev_saves_output = i > 0 and units[i - 1].name not in recomputed
        if unit.name in recomputed:
            kept = a.inputs.at(mb)  # the checkpoint keeps the unit's inputs alive
            if i == 0 and not first:
                kept = 0  # the receive buffer already holds them
            elif prev_saves_output:
                kept -= min(kept, acts[i - 1].saved_output.at(mb))
        else:
            kept = a.saved.at(mb)
            if i == 0 and not first:
                kept -= a.saved_input.at(mb)  # saved input = the receive buffer
            elif i > 0 and units[i - 1].name in recomputed:
                kept += acts[i - 1].saved_output.at(mb)  # the input the recomputed unit no longer saves
        total += kept + a.after.at(mb)
    return total
