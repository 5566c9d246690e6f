"""What the job's own runs say beyond the time model: the fits of its measured steps, charged to every plan.

Under ``plan="auto"`` the job runs its own model through the strategy's step, as replicas at two
accumulation windows and as a pipeline of two ranks at two micro-batch counts
(``strategies/pipeline/auto_measure.py``). Each pair of measured steps against what
:func:`~lightning_parallel.planner.time_model.step_time` predicts for them gives two unknowns of the
links' :class:`~lightning_parallel.planner.links.StepOverhead`: :func:`as_run` the stages' compute ratio
and what a step pays once, :func:`pipelined_as_run` what a pipelined action and batch pay beyond the
model. Pure arithmetic over the time model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.facts import ModelFacts
from lightning_parallel.planner.links import Links, StepOverhead
from lightning_parallel.planner.time_model import step_time


def as_run(
    facts: ModelFacts,
    links: Links,
    plan: ParallelPlan,
    samples: int,
    measured: Mapping[int, float],
) -> StepOverhead:
    """What every step pays and how the stages run, from ``plan``'s real steps measured on the job.

    ``measured``: seconds of one optimizer step of ``plan`` (the job's own model run by the strategy's
    step, ``samples`` per replica per batch) at two accumulation windows (batches per step). The batches'
    difference is what one more batch takes as run; beyond what the model charges a batch besides the
    stages' compute (the plan's overhead per batch and per action), it is the stages' compute as run,
    whose ratio to the facts' lines of that compute becomes ``compute``. That ratio scales the facts'
    lines in every plan, so it is taken to them, not to the units timed again beside the steps (under
    another load than the facts': a pair that mapped the lines 2x over in one job). What the step pays once
    beyond the batches (the windows' line at zero batches) beyond what the model predicts there (the
    gradient sync, the optimizer step, the step's bookkeeping) is added to ``per_step`` (never below
    zero). A plan of one stage per rank (the replicas'): its batch is its units' forward and backward.

    Raises:
        ValueError: fewer than two windows, a plan of several stages, or facts without unit times.

    Example::

        seconds = time_windows(trainer, model, replicas, batch, meshes, (2, 5), (1, 3))   # every rank
        links = replace(links, overhead=as_run(facts, links, replicas, 8, dict(zip((1, 3), seconds))))
    """
    if len(measured) < 2:
        raise ValueError(f"as_run needs the plan measured at two accumulation windows, got {dict(measured)}")
    if plan.pipeline_size != 1:
        raise ValueError(f"as_run reads a plan of one stage per rank, got pipeline_size={plan.pipeline_size}")
    (w1, t1), (w2, t2) = sorted(measured.items())[0], sorted(measured.items())[-1]
    # (the strategy's own step runs without Lightning's loop: fitted without it, kept after)
    plain = replace(links.overhead, compute=1.0, loop_step=0.0, loop_batch=0.0)
    with_base = replace(links, overhead=plain)
    # One batch's stages: their forward and backward of every micro-batch, nothing else charged.
    stages = step_time(facts, replace(links, overhead=StepOverhead()), plan, samples).schedule
    p1, p2 = (step_time(facts, with_base, plan, samples, w).seconds for w in (w1, w2))
    per_batch, predicted_batch = (t2 - t1) / (w2 - w1), (p2 - p1) / (w2 - w1)
    others = predicted_batch - stages  # what the model charges a batch beside the stages' compute
    scale = (per_batch - others) / stages if stages > 0 else 1.0
    if not math.isfinite(scale) or scale <= 0:
        scale = 1.0  # (a difference lost in the noise: the units as timed)
    rest = (t1 - w1 * per_batch) - (p1 - w1 * predicted_batch)  # once per step, measured - predicted
    loop = {"loop_step": links.overhead.loop_step, "loop_batch": links.overhead.loop_batch}
    return replace(plain, per_step=max(0.0, plain.per_step + rest), compute=scale, **loop)


def pipelined_as_run(
    facts: ModelFacts,
    links: Links,
    plan: ParallelPlan,
    samples: int,
    measured: Mapping[int, float],
) -> StepOverhead:
    """What a plan of several pipeline ranks pays beyond the model, from ``plan``'s real steps on the job.

    ``measured``: seconds of one optimizer step of ``plan`` (several pipeline ranks; the job's own model
    run by the strategy's step, one batch of ``samples`` per replica) at two micro-batch counts,
    ``{num_microbatches: seconds}``. Each count's step beyond the prediction (``links`` as the replicas'
    run set them, nothing charged for being pipelined) is ``batch + action x k``, where ``k`` is how much
    the predicted step grows per second added to every forward and backward (the actions on the critical
    path, read from the schedule's simulation): two counts, two unknowns. ``action`` becomes
    ``pipelined_action``, ``batch`` ``pipelined_batch``, charged to every plan of several pipeline ranks
    per forward or backward and per batch: what the point-to-point sends and receives between the ranks
    and their waits cost beyond what the model charges them (the link probe's send latency, noisy). Either
    may be negative (the model over-charging them: the probe's send 2 ms on one job, less in its run),
    never below what the model charges beside the compute (an action's bookkeeping and one send's
    latency; a batch's bookkeeping).

    Raises:
        ValueError: fewer than two counts, or a plan of one pipeline rank.

    Example::

        seconds = time_runs(trainer, model, [(replace(pp, num_microbatches=m), 1) for m in (2, 8)], ...)
        links = replace(links, overhead=pipelined_as_run(facts, links, pp, 8, dict(zip((2, 8), seconds))))
    """
    if len(measured) < 2:
        raise ValueError(f"pipelined_as_run needs two micro-batch counts, got {dict(measured)}")
    if plan.pipeline_size < 2:
        raise ValueError(f"pipelined_as_run reads a plan of several pipeline ranks, got {plan.label()}")
    loop = {"loop_step": links.overhead.loop_step, "loop_batch": links.overhead.loop_batch}
    base = replace(links.overhead, pipelined_batch=0.0, pipelined_action=0.0, loop_step=0.0, loop_batch=0.0)
    probe = replace(base, pipelined_action=1e-3)
    points = []
    for m, seconds in sorted(measured.items()):
        run = replace(plan, num_microbatches=m)
        plain = step_time(facts, replace(links, overhead=base), run, samples).seconds
        critical = (step_time(facts, replace(links, overhead=probe), run, samples).seconds - plain) / 1e-3
        points.append((critical, seconds - plain))
    (k1, r1), (k2, r2) = points[0], points[-1]
    # An action is never cheaper than its compute: what the model charges beside it (the runtime's
    # bookkeeping, the point-to-point latency) is the most a pipelined action can take back.
    least = -(base.per_action + links.send(1))
    action = max(least, (r2 - r1) / (k2 - k1)) if k2 > k1 else 0.0
    batch = max(-base.per_batch, r1 - action * k1)
    return replace(base, pipelined_batch=batch, pipelined_action=action, **loop)
