"""The sequence-length axis: the longest sequence that trains on N devices, per sequence-parallel size.

``python -m lightning_parallel.planner ... --batch long:32768 long:32768 --longest`` answers "what length
fits on N devices of M GiB?": the length in ``--batch`` is the upper bound; the planner halves it until
every sequence-parallel size ``k`` it offers has a plan that fits, then bisects, per ``k``, between the
longest length that fits and the shortest that does not, to a multiple of every ``k`` (and of
``--length-multiple``): no length a ``k`` cannot split is reported. ``--lengths 4096,8192`` asks at those
lengths instead. Each length's plans are the whole search's (pipeline, recomputation, ZeRO-1/FSDP2,
offload, ``k``), sized and timed from the model measured at three short lengths
(:mod:`~lightning_parallel.planner.lengths`); a longer sequence costs no new measurement.

The peak of every plan grows with the length (activations are never smaller for more tokens), so
"some plan of ``k`` fits" holds up to one length and not beyond: the bisection finds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lightning_parallel._table import format_table
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import format_bytes
from lightning_parallel.planner.lengths import LengthFacts
from lightning_parallel.planner.links import Links
from lightning_parallel.planner.ranking import Budget, Candidate, fastest_fit, rank_plans, ranked
from lightning_parallel.planner.search import Search

Keep = Callable[[ParallelPlan], bool]
"""Which plans a length search considers (``longest_lengths(..., keep=...)``)."""


@dataclass(frozen=True)
class LengthFit:
    """At ``tokens`` a sample: the fastest plan that fits (of sequence-parallel size ``k``; ``None``: any
    ``k``), or ``None`` where none does."""

    tokens: int
    k: int | None
    best: Candidate | None

    @property
    def tokens_per_second(self) -> float:
        """Tokens trained per second by the best plan (samples per step x length / step time)."""
        c = self.best
        if c is None or c.time is None or c.seconds <= 0:
            return float("nan")
        return c.samples * self.tokens / c.seconds


@dataclass(frozen=True)
class LengthTable:
    """The answer: the best plan at each length tried, and the longest length per sequence-parallel size.

    ``bounded``: the ``k`` whose longest is the upper bound itself (longer ones might fit too).
    """

    rows: list[LengthFit]
    longest: list[LengthFit]
    multiple: int
    upper: int
    bounded: frozenset[int] = frozenset()
    asked: str = ""  # (the lengths asked, where they were given)

    def best(self) -> LengthFit | None:
        """The longest length that fits at all, with its fastest plan (of every ``k`` reaching it)."""
        found = [f for f in self.longest if f.best is not None]
        if not found:
            return None
        top = max(f.tokens for f in found)
        fastest = ranked([f.best for f in found if f.tokens == top and f.best is not None])[0]
        return next(f for f in found if f.best is fastest)

    def format(self, budget: Budget) -> str:
        """The two tables (by length, then the longest per ``k``) and the longest overall as code."""
        by_length = format_table(
            ["sequence length", "sp", "fastest plan that fits", *_COLUMNS],
            [[str(f.tokens), *_row(f, budget)] for f in self.rows],
        )
        per_k = format_table(
            ["sp", "longest sequence", "fastest plan that fits", *_COLUMNS],
            [[str(f.k), _tokens(f, self.bounded), *_row(f, budget)[1:]] for f in self.longest],
        )
        how = self.asked or f"in multiples of {self.multiple} up to {self.upper}"
        lines = [by_length, "", f"longest sequence per sequence-parallel size (sp), {how}:", per_k, ""]
        top = self.best()
        if top is None or top.best is None:
            return "\n".join([*lines, f"no plan fits {budget.describe()} even at {self.multiple} tokens"])
        lines.append(f"longest: {top.tokens} tokens a sample, sp {top.k}: {top.best.plan.label()}")
        lines.append(f"    {top.best.plan.code()}")
        return "\n".join(lines)


_COLUMNS = ["device peak", "host/node", "step", "tokens/s"]


def _row(f: LengthFit, budget: Budget) -> list[str]:
    c = f.best
    if c is None:
        return ["-", f"none fits {format_bytes(budget.usable)}", "-", "-", "-", "-"]
    step = f"{c.seconds * 1e3:.1f} ms" if c.time else "-"
    rate = f"{f.tokens_per_second:,.0f}" if c.time else "-"
    sp = str(c.plan.sequence_parallel_size)
    return [sp, c.plan.label(), format_bytes(c.peak), format_bytes(c.host_per_node), step, rate]


def _tokens(f: LengthFit, bounded: frozenset[int]) -> str:
    if f.best is None:
        return "-"
    return f">= {f.tokens} (the upper bound)" if f.k in bounded else str(f.tokens)


def candidates_at(
    scaled: LengthFacts,
    tokens: int,
    search: Search,
    links: Links | None = None,
    k: int | None = None,
    keep: Keep | None = None,
) -> list[Candidate]:
    """Every plan of ``search`` at ``tokens`` a sample (of sequence-parallel size ``k``; ``None``: any;
    ``keep``: those it accepts), sized and timed from ``scaled``; fastest first."""
    facts = scaled.at(tokens)
    out: list[Candidate] = []
    for tp in search.tensor_parallel_sizes:
        f = facts[tp]
        plans = search.plans(f.layout.max_stages, tp, f.layout.kind, f)
        plans = [p for p in plans if (k is None or p.sequence_parallel_size == k) and (keep or bool)(p)]
        out += rank_plans(f, plans, search, links)
    return ranked(out)


def sequence_sizes(scaled: LengthFacts, search: Search) -> list[int]:
    """The sequence-parallel sizes the search offers on its devices (1 included), whatever the length."""
    found = {1}
    for tp, f in scaled.facts.items():
        any_length = dataclasses.replace(f, tokens=0)  # (0: every k splits it)
        plans = search.plans(f.layout.max_stages, tp, f.layout.kind, any_length)
        found |= {p.sequence_parallel_size for p in plans}
    return sorted(found)


def longest_lengths(
    scaled: LengthFacts,
    search: Search,
    budget: Budget,
    links: Links | None = None,
    upper: int | None = None,
    multiple: int = 1,
    lengths: Iterable[int] | None = None,
    keep: Keep | None = None,
) -> LengthTable:
    """The best plan per length and the longest length per sequence-parallel size that fits ``budget``.

    Without ``lengths``: halving from ``upper`` (default: the longest length measured), then bisection per
    ``k``, every length a multiple of each ``k`` and of ``multiple``. With ``lengths``: those only (a
    ``k`` that does not divide one is not tried there). ``keep``: the plans to consider (e.g.
    ``lambda p: not p.activation_checkpointing``; default all).

    Raises:
        ValueError: ``upper`` below one multiple; a length that is not positive.

    Example::

        scaled = measure_lengths(model, batch_at, search, upper=32768)
        table = longest_lengths(scaled, search, Budget(80 * 2**30), links, upper=32768)
        print(table.format(budget))
    """
    ks = sequence_sizes(scaled, search)
    step = math.lcm(multiple, *ks)
    if lengths is not None:
        return _at_lengths(scaled, search, budget, links, sorted(set(lengths)), ks, step, keep)
    upper = scaled.reference if upper is None else upper
    top = upper // step * step
    if top < step:
        raise ValueError(f"the upper length ({upper}) is below one multiple of every k ({ks}) "
                         f"and --length-multiple: {step}")  # fmt: skip
    tried: dict[int, dict[int, Candidate | None]] = {}
    t = top
    while True:
        tried[t] = _best_per_k(candidates_at(scaled, t, search, links, keep=keep), budget, ks)
        if all(tried[t][k] is not None for k in ks) or t == step:
            break
        t = max(step, t // 2 // step * step)
    rows = [LengthFit(t, None, _fastest(per_k.values())) for t, per_k in sorted(tried.items())]
    longest = [_bisected(scaled, search, budget, links, tried, k, step, keep) for k in ks]
    bounded = frozenset(f.k for f in longest if f.best is not None and f.tokens == top and f.k is not None)
    return LengthTable(rows, longest, step, top, bounded)


def _at_lengths(
    scaled: LengthFacts,
    search: Search,
    budget: Budget,
    links: Links | None,
    lengths: list[int],
    ks: list[int],
    step: int,
    keep: Keep | None = None,
) -> LengthTable:
    if not lengths or lengths[0] < 1:
        raise ValueError(f"sequence lengths must be positive, got {lengths}")
    tried = {t: _best_per_k(candidates_at(scaled, t, search, links, keep=keep), budget, ks) for t in lengths}
    rows = [LengthFit(t, None, _fastest(per_k.values())) for t, per_k in tried.items()]
    longest = []
    for k in ks:
        fits = [t for t in lengths if tried[t][k] is not None]
        longest.append(LengthFit(fits[-1], k, tried[fits[-1]][k]) if fits else LengthFit(0, k, None))
    asked = f"of the lengths asked ({', '.join(map(str, lengths))})"
    return LengthTable(rows, longest, step, lengths[-1], asked=asked)


def _best_per_k(candidates: list[Candidate], budget: Budget, ks: list[int]) -> dict[int, Candidate | None]:
    return {k: fastest_fit([c for c in candidates if c.plan.sequence_parallel_size == k], budget) for k in ks}


def _fastest(found: Iterable[Candidate | None]) -> Candidate | None:
    fits = [c for c in found if c is not None]
    return ranked(fits)[0] if fits else None


def _bisected(
    scaled: LengthFacts,
    search: Search,
    budget: Budget,
    links: Links | None,
    tried: dict[int, dict[int, Candidate | None]],
    k: int,
    step: int,
    keep: Keep | None = None,
) -> LengthFit:
    """``k``'s longest length that fits: between the longest tried that fits and the next tried above."""
    fits = [t for t in sorted(tried) if tried[t][k] is not None]
    if not fits:
        return LengthFit(0, k, None)
    lo = fits[-1]
    above = [t for t in sorted(tried) if t > lo]
    best = tried[lo][k]
    if not above:
        return LengthFit(lo, k, best)
    hi = above[0]
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        found = fastest_fit(candidates_at(scaled, mid, search, links, k, keep), budget)
        if found is None:
            hi = mid
        else:
            lo, best = mid, found
    return LengthFit(lo, k, best)


# ---------------------------------------------------------------------------- the command's part


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's length-axis options (``--longest``, ``--lengths``, ``--length-multiple``)."""
    parser.add_argument(
        "--longest", action="store_true",
        help="the longest sequence that fits, per sequence-parallel size: --batch's length is the upper "
        "bound, halved then bisected (the model measured at three short lengths, not at each)",
    )  # fmt: skip
    parser.add_argument("--lengths", type=_lengths, metavar="T1,T2,...",
                        help="the best plan at these sequence lengths (at most --batch's)")  # fmt: skip
    parser.add_argument("--length-multiple", type=int, default=1, metavar="N",
                        help="--longest: lengths in multiples of N (and of every k; default 1)")  # fmt: skip


def _lengths(text: str) -> list[int]:
    try:
        found = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"write lengths as 4096,8192,..., got {text!r}") from None
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be positive integers, got {text!r}")
    return found


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command asks about the length axis."""
    return bool(getattr(args, "longest", False) or getattr(args, "lengths", None))


def specs_at(specs: list[str], tokens: int) -> tuple[list[str], int]:
    """``--batch``'s specs at ``tokens`` a sample: each first dimension equal to the first spec's becomes
    ``tokens``; and that length (the upper bound).

    Example::

        >>> specs_at(["long:64", "long:64", "float32:3,32"], 16)
        (['long:16', 'long:16', 'float32:3,32'], 64)

    Raises:
        ValueError: no spec with a sequence dimension.
    """
    shaped = [s for s in specs if s.partition(":")[2].strip()]
    if not shaped:
        raise ValueError("--longest and --lengths need --batch with a sequence length, e.g. long:32768")
    length = int(shaped[0].partition(":")[2].split(",")[0])
    out = []
    for spec in specs:
        dtype, _, shape = spec.partition(":")
        dims = shape.split(",") if shape.strip() else []
        if dims and int(dims[0]) == length:
            dims[0] = str(tokens)
        out.append(f"{dtype}:{','.join(dims)}" if dims else spec)
    return out, length


def run(
    args: argparse.Namespace,
    search: Search,
    budget: Budget,
    model: Any,
    optimizer: Any,
    make_batch: Callable[[list[str], int], Any],
    links: Callable[[], Links],
) -> int:
    """The command with ``--longest`` / ``--lengths``: print the length tables; 0, or 1 if nothing fits.

    Raises:
        ValueError: no sequence length in ``--batch``; a length above it; what measuring raises.
    """
    from lightning_parallel.planner.lengths import measure_lengths
    from lightning_parallel.planner.units import find_units

    upper = specs_at(args.batch or [], 1)[1]
    if args.lengths and max(args.lengths) > upper:
        raise ValueError(f"--lengths up to {max(args.lengths)} tokens: give --batch at least that long "
                         f"(it is {upper}; the model is measured at most at its length)")  # fmt: skip
    # (the length axis splits sequences at any length, "auto" included; "no" keeps its plans unsplit)
    search = dataclasses.replace(search, sequence_parallel=search.options["sequence_parallel"] is not False)
    samples = search.micro_batch_sizes(find_units(model).max_stages)[1]

    def batch_at(tokens: int) -> Any:
        return make_batch(specs_at(args.batch, tokens)[0], samples)

    scaled = measure_lengths(model, batch_at, search, upper, optimizer, multiple=args.length_multiple)
    table = longest_lengths(scaled, search, budget, links(), upper, args.length_multiple, args.lengths)
    first = scaled.facts[search.tensor_parallel_sizes[0]]
    params = sum(t.numel for t in first.tensors.values())
    timed = "timed" if first.times is not None else "not timed (meta)"
    print(
        f"{args.model}: {params:,} parameters, {first.layout.describe()}; global batch "
        f"{args.global_batch_size}, {args.devices} devices, {args.precision}; budget {budget.describe()}"
    )
    measured = ", ".join(map(str, scaled.lengths))
    print(f"sequence lengths: the model measured at {measured} tokens ({timed} at {scaled.reference}); "
          f"bytes fitted in the length, times scaled by the work per token\n")  # fmt: skip
    print(table.format(budget))
    return 0 if table.best() is not None else 1
