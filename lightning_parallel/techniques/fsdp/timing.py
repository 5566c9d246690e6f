"""FSDP2 timed in place, for the planner: each sampled unit sharded over the job's ranks against a plain copy.

The planner's time model cannot derive FSDP2's costs from the links alone (its hooks, its gradient
accumulation, its all-gather of many small tensors), so ``plan="auto"`` measures them on the job before
the search (the technique's ``measure`` member) and charges them per unit (``time``): :class:`FsdpTimes`,
lines in a unit's parameter bytes. Apart from the technique because it runs FSDP2 on copies of the
model's units, timed, with collectives over every rank of the job.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

from lightning_parallel.techniques.fsdp._internals import finish_backward
from lightning_parallel.techniques.ledgers import Line, TimeBench, TimeLedger


@dataclass(frozen=True)
class FsdpTimes:
    """FSDP2 measured in place over ``shards`` ranks, per unit, as lines in its parameter bytes.

    ``gather``: the all-gather before the unit's first forward and the end of its backward, once per batch
    (each ``schedule.step()`` reshards); ``forward``/``backward``: what FSDP2 adds to the unit's own
    forward and backward on each micro-batch (its hooks; the unsharded gradients' accumulation);
    ``reduce``: the reduce-scatter of its gradients, once per optimizer step; ``step``: what the model's
    optimizer pays to step the unit's shards as DTensors beyond the same step on plain tensors of their
    size (DTensor's dispatch on every op of every tensor: 3x the plain step of the bench's CharLM here).

    Example::

        times = fsdp.measure_units(bench)       # on every rank of the job
        times.backward.at(800_000)              # seconds FSDP2 adds to a 800 KB block's backward
    """

    shards: int
    gather: Line
    forward: Line
    backward: Line
    reduce: Line
    step: Line = field(default_factory=Line)

    def charge(self, ledger: TimeLedger, shards: int) -> None:
        """Add the rank's units' seconds to its ledger (collectives rescaled to ``shards`` as a ring moves
        bytes: ``(k - 1) / k`` of them). Each stage's root, which holds no parameters of its own (its
        blocks hold them), pays FSDP2's hooks on every micro-batch but has no all-gather nor
        reduce-scatter of its own."""
        ring = (shards - 1) / shards / ((self.shards - 1) / self.shards)
        tensors, params = ledger.facts.tensors, ledger.facts.unit_params
        for c in ledger.stages:
            sizes = [sum(tensors[k].nbytes for k in params.get(n, [])) for n in c.units]
            forward = sum(self.forward.at(b) for b in [*sizes, 0])  # (+ the root's hooks)
            backward = sum(self.backward.at(b) for b in [*sizes, 0])
            ledger.forward[c.index] += forward
            ledger.backward[c.index] += backward
            ledger.share(c.index, "communication", forward + backward)
            ledger.start += ring * sum(self.gather.at(b) for b in sizes if b)
            ledger.tail["communication"] += ring * sum(self.reduce.at(b) for b in sizes if b)
            ledger.step_extra += sum(self.step.at(b) for b in sizes if b)


def measure_units(bench: TimeBench) -> FsdpTimes:
    """Each sampled unit sharded with ``fully_shard`` over the job's ranks (``reshard_after_forward=False``,
    gradient sync off, as a stage runs it) and a plain copy, on one micro-batch of the smallest size: the
    all-gather, the forward, the forward and backward, the end of the backward, the reduce-scatter; the
    differences from the plain copy, per unit, fitted as lines in the units' bytes.

    Example::

        FSDP_TIMES = measure_units(bench)     # every rank of the job calls it
    """
    mesh = bench.mesh((bench.ranks,), ("shard",))
    size = min(bench.sizes)
    points = []
    for sample in bench.samples:
        args, kwargs = bench.inputs(sample, size)
        plain = copy.deepcopy(sample.module).to(bench.device)
        sharded = copy.deepcopy(sample.module).to(bench.device)
        fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
        plain_forward = bench.timed(lambda m=plain, a=args, k=kwargs: m(*a, **k))
        plain_both = bench.timed(lambda m=plain, a=args, k=kwargs: TimeBench.backward(m(*a, **k)))
        gather, forward, both, end, reduce = _sharded_step(sharded, args, kwargs, bench)
        extra_backward = (both - forward) - (plain_both - plain_forward)
        step = _step_beyond_plain(sharded, bench)
        points.append((sample.nbytes, gather + end, forward - plain_forward, extra_backward, reduce, step))
        for p in sharded.parameters():
            p.grad = None
    return FsdpTimes(bench.ranks, *(Line.through((p[0], p[i]) for p in points) for i in range(1, 6)))


def _step_beyond_plain(sharded: Any, bench: TimeBench) -> float:
    """Seconds of the model's optimizer stepping ``sharded``'s DTensor shards (their gradients reduced)
    beyond the same optimizer on plain copies of the local shards (what the time model charges the
    step otherwise); 0 without the optimizer or gradients."""
    shards = [p for p in sharded.parameters() if p.grad is not None]
    if bench.optimizer is None or not shards:
        return 0.0
    local = [p.to_local().detach().clone().requires_grad_() for p in shards]
    for plain, p in zip(local, shards):
        plain.grad = p.grad.to_local().clone()
    on_shards, on_plain = bench.optimizer(shards), bench.optimizer(local)
    with torch.no_grad():
        return max(0.0, bench.timed(on_shards.step) - bench.timed(on_plain.step))


def _sharded_step(sharded: Any, args: Any, kwargs: Any, bench: TimeBench) -> tuple[float, ...]:
    """Median seconds of: the all-gather, a forward, a forward and backward, the end of that backward
    (gradients kept), the reduce-scatter; one micro-batch per repeat, as a schedule step runs it (the
    backward set as a stage sets each micro-batch's: :func:`_as_a_micro_batch`).

    Each piece is timed from the ranks lined up to its own end, as :meth:`TimeBench.timed` times: a
    barrier inside a span would add the ranks' skew and a barrier's latency to every piece, per unit (the
    real stage lines nothing up between its units), which the time model would then charge every unit on
    every micro-batch."""
    pieces = (
        sharded.unshard,
        lambda: sharded(*args, **kwargs),
        lambda: TimeBench.backward(sharded(*args, **kwargs)),
        lambda: finish_backward(sharded, reduce=False),
        lambda: finish_backward(sharded, reduce=True),
    )
    runs: list[list[float]] = []
    for repeat in range(bench.repeats + 1):
        _as_a_micro_batch(sharded)
        spans = [bench.span(piece) for piece in pieces]
        if repeat:
            runs.append(spans)
        sharded.reshard()
    return tuple(statistics.median(r[i] for r in runs) for i in range(len(pieces)))


def _as_a_micro_batch(sharded: Any) -> None:
    """Set ``sharded`` as torch's ``PipelineStage`` sets a stage before each micro-batch's backward: not
    the last backward, no reshard after it, no gradient sync. Left at FSDP2's defaults (the last backward,
    reshard after it), each measured backward held the window's end (the reshard, the final callback's
    finalisation), which a stage pays once per batch (``finish_backward``, the ``gather`` line's end)
    and the time model charged on every micro-batch."""
    sharded.set_is_last_backward(False)
    sharded.set_reshard_after_backward(False)
    sharded.set_requires_gradient_sync(False)
