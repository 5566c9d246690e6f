"""The method of every timing in ``experiments/``: interleaved repeats, medians, min-max ranges, and
docs/results.md's wording of a ratio. Pure Python; scripts reach it through ``_harness`` (``h.interleave``).

On a shared machine a timing moves by more than most effects measured, so a benchmark never compares
two separate runs. It runs its variants interleaved inside one invocation (``A B, B A, A B, ...``; with
three variants the first one rotates), at least :data:`MIN_REPEATS` times each, and reports the median
of the per-repeat ratios against a baseline with their min-max range, beside the absolute medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MIN_REPEATS",
    "Spread",
    "compare",
    "interleave",
    "order",
    "per_repeat_ratios",
    "spread",
    "verdict",
]

MIN_REPEATS = 5
"""The fewest interleaved repeats of each variant behind a timing shown in docs/results.md."""

Row = dict[str, Any]


def order(names: Sequence[str], repeat: int) -> list[str]:
    """The order of the variants in repeat ``repeat``: rotated by one each repeat (ABAB..., ABC BCA CAB).

    Example::

        h.order(["a", "b"], 1)   # ["b", "a"]
    """
    shift = repeat % len(names)
    return list(names[shift:]) + list(names[:shift])


def interleave(
    variants: Mapping[str, Callable[[], Mapping[str, float] | float]],
    repeats: int,
    before_each: Callable[[], None] | None = None,
    warmup: bool = False,
) -> list[Row]:
    """Run every variant ``repeats`` times, interleaved, with the first one rotating; return the samples.

    A variant returns a number or a dict of numbers (its measurements); a number is stored as
    ``"value"``. Each sample is ``{"repeat", "variant", "position", **measurements}``. ``before_each``
    runs before every measurement (``h.barrier`` lines the ranks up). ``warmup`` runs each variant
    once first and drops the result (first-call costs: imports, allocator, thread pools).

    Example::

        samples = h.interleave({"sum": lambda: timed(sum), "fsum": lambda: timed(math.fsum)}, 5)
    """
    if repeats < 1 or not variants:
        raise ValueError(f"interleave needs variants and repeats >= 1 (got {len(variants)}, {repeats})")
    names = list(variants)
    if warmup:
        for name in names:
            if before_each is not None:
                before_each()
            variants[name]()
    samples: list[Row] = []
    for rep in range(repeats):
        for position, name in enumerate(order(names, rep)):
            if before_each is not None:
                before_each()
            measured = variants[name]()
            values = dict(measured) if isinstance(measured, Mapping) else {"value": measured}
            samples.append(dict(repeat=rep, variant=name, position=position, **values))
    return samples


@dataclass(frozen=True)
class Spread:
    """The median of some per-repeat values and their min-max range."""

    median: float
    lo: float
    hi: float
    n: int

    def cells(self, key: str, digits: int = 4) -> Row:
        """``{key: median, key_min: lo, key_max: hi}``, rounded: the CSV columns of a timing."""
        return {
            key: round(self.median, digits),
            f"{key}_min": round(self.lo, digits),
            f"{key}_max": round(self.hi, digits),
        }


def spread(values: Iterable[float]) -> Spread:
    """Median, minimum, maximum and count of ``values``.

    Example::

        h.spread([1.0, 3.0, 2.0])   # Spread(median=2.0, lo=1.0, hi=3.0, n=3)
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread() of no values: the benchmark recorded no repeat")
    return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


def per_repeat_ratios(samples: Sequence[Row], metric: str, variant: str, baseline: str) -> list[float]:
    """``metric`` of ``variant`` over ``metric`` of ``baseline``, one ratio per repeat both ran in."""
    by = {(s["repeat"], s["variant"]): float(s[metric]) for s in samples}
    reps = sorted({s["repeat"] for s in samples})
    return [by[(r, variant)] / by[(r, baseline)] for r in reps if (r, variant) in by and (r, baseline) in by]


def compare(
    samples: Sequence[Row], metric: str, baseline: str, ratio: str = "ratio", digits: int = 4
) -> list[Row]:
    """One row per variant: the median of ``metric`` with its range, and the median of the per-repeat
    ratios ``variant / baseline`` with their range (columns ``ratio``, ``ratio_min``, ``ratio_max``).

    Example::

        rows = h.compare(samples, "step_ms", baseline="off")
        rows[1]["ratio"], rows[1]["ratio_min"], rows[1]["ratio_max"]
    """
    rows = []
    for name in dict.fromkeys(s["variant"] for s in samples):
        values = [s[metric] for s in samples if s["variant"] == name]
        row: Row = {"variant": name, "repeats": len(values)}
        row |= spread(values).cells(metric, digits)
        row |= spread(per_repeat_ratios(samples, metric, name, baseline)).cells(ratio, digits)
        rows.append(row)
    return rows


def verdict(
    lo: float,
    hi: float,
    goal: float | None = None,
    higher_is_better: bool = True,
    words: tuple[str, str] = ("better", "worse"),
) -> str:
    """How docs/results.md words a ratio measured over repeats, from its min-max range ``[lo, hi]``.

    A range that includes parity (1) or the goal is "within noise": the repeats do not decide it.
    Otherwise the ratio meets or misses the goal, or (no goal) is better or worse than the baseline,
    in every repeat.

    Example::

        h.verdict(0.89, 0.99, goal=0.95)      # "within noise"
        h.verdict(0.02, 0.06, higher_is_better=False, words=("cheaper", "dearer"))
        # "cheaper in every repeat"
    """
    marks = [1.0] if goal is None else [1.0, goal]
    if any(lo <= m <= hi for m in marks):
        return "within noise"
    if goal is not None:
        met = lo > goal if higher_is_better else hi < goal
        return "meets the goal in every repeat" if met else "misses the goal in every repeat"
    better = lo > 1.0 if higher_is_better else hi < 1.0
    return f"{words[0] if better else words[1]} in every repeat"
