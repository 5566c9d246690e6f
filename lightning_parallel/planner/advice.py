"""When nothing fits: the smallest peak found, by how much it misses, and what would make a plan fit.

Each suggestion is computed, not guessed: the same model's facts, searched again with one thing
changed (twice the devices, half the batch per replica with twice the accumulation, offload), and
the smallest peak that search finds is quoted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import format_bytes
from lightning_parallel.planner.facts import ModelFacts
from lightning_parallel.planner.links import Links
from lightning_parallel.planner.ranking import Budget, Candidate, fastest_fit, plan_search
from lightning_parallel.planner.search import Search
from lightning_parallel.techniques import search_options


class NothingFits(ValueError):
    """No plan of the search fits the budget; the message says by how much and what would fit."""


def choose(
    facts: Mapping[int, ModelFacts],
    search: Search,
    budget: Budget,
    links: Links | None = None,
    candidates: list[Candidate] | None = None,
) -> Candidate:
    """The fastest plan of ``search`` that fits ``budget``.

    Raises:
        NothingFits: none fits (the message: the smallest peak, the miss, and what would fit).

    Example::

        best = choose({1: facts}, Search(devices=4, global_batch_size=64), Budget(24 * 2**30), links)
        PipelineStrategy.from_plan(best.plan)
    """
    candidates = plan_search(facts, search, links) if candidates is None else candidates
    best = fastest_fit(candidates, budget)
    if best is None:
        raise NothingFits(nothing_fits(facts, search, budget, candidates))
    return best


def nothing_fits(
    facts: Mapping[int, ModelFacts], search: Search, budget: Budget, candidates: list[Candidate]
) -> str:
    """The message of :class:`NothingFits`."""
    if not candidates:
        stages = max(f.layout.max_stages for f in facts.values())
        return search.split_error(stages) or f"the search on {search.devices} devices has no plan to size"
    smallest = min(candidates, key=lambda c: (c.peak, c.host_per_node))
    over = smallest.peak - budget.usable
    lines = [
        f"no plan fits {budget.describe()}: the smallest device peak is {format_bytes(smallest.peak)} "
        f"({smallest.plan.label()}), "
        + (f"{format_bytes(over)} ({over / budget.usable:.0%}) over the {format_bytes(budget.usable)} usable"
           if over > 0 else f"within the device budget, but its node needs "
           f"{format_bytes(smallest.host_per_node)} of host memory")
    ]  # fmt: skip
    lines.append("what would fit (each searched with this model's measurements):")
    lines += [f"  - {s}" for s in suggestions(facts, search, budget)]
    return "\n".join(lines)


def suggestions(facts: Mapping[int, ModelFacts], search: Search, budget: Budget) -> list[str]:
    """One line per change: the smallest peak the search finds with it, and whether that fits."""
    out = []
    wider = replace(search, devices=2 * search.devices, pipeline_sizes=None, ranks_per_node=None)
    out.append(_line(f"{wider.devices} devices", facts, wider, budget))
    batch = _per_replica(search)
    if batch > 1:
        global_batch = search.global_batch_size or batch * search.devices
        halved = replace(search, batch_size=batch // 2, global_batch_size=global_batch)
        what = f"a batch of {batch // 2} per replica (accumulating twice as many)"
        out.append(_line(what, facts, halved, budget))
    searched = ["recomputation", "sharded optimizer state"]
    for option in search_options():  # (a technique's search option moved off its default: offload)
        if not option.suggest:
            continue
        if search.options[option.name] == option.default:
            searched.append(option.suggest)
        else:
            wide = replace(search, **{option.name: option.default})
            out.append(_line(option.suggest, facts, wide, budget, search))
    listed = f"{', '.join(searched[:-1])} and {searched[-1]}"
    out.append(f"{listed} are in the search already; a smaller precision (bf16-mixed) is measured again "
               "with --precision / Trainer(precision=...)")  # fmt: skip
    return out


def _per_replica(search: Search) -> int:
    if search.batch_size is not None:
        return search.batch_size
    assert search.global_batch_size is not None
    return search.global_batch_size // search.devices or 1


def _plans(facts: Mapping[int, ModelFacts], search: Search) -> list[ParallelPlan]:
    """The plans ``search`` tries (unsized), at each tensor-parallel size measured."""
    return [
        plan
        for tp in search.tensor_parallel_sizes
        for plan in search.plans(facts[tp].layout.max_stages, tp, facts[tp].layout.kind, facts[tp])
    ]


def _line(
    what: str,
    facts: Mapping[int, ModelFacts],
    search: Search,
    budget: Budget,
    beyond: Search | None = None,
) -> str:
    """``what``'s line: the smallest peak of ``search``'s plans (with ``beyond``: of those it adds to
    ``beyond``'s, the search it widens)."""
    try:
        found = plan_search(facts, search)
    except ValueError as err:
        return f"{what}: not searchable ({err})"
    if beyond is not None:
        tried = set(_plans(facts, beyond))
        found = [c for c in found if replace(c.plan, accumulate_grad_batches=1) not in tried]
    if not found:
        return f"{what}: no plan divides the batch"
    smallest = min(found, key=lambda c: c.peak)
    verdict = "fits" if budget.fits(smallest) or fastest_fit(found, budget) else "still over"
    return f"{what}: smallest peak {format_bytes(smallest.peak)} ({smallest.plan.label()}): {verdict}"
