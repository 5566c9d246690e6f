"""What an experiment declares of its results in docs/results.md, and the formatting its tables share.

Each experiment script declares, beside the code that writes its CSVs, what the page shows of them::

    def watchdog(rows: t.Rows) -> str:           # one function per CSV, named after it (watchdog.csv)
        return t.table(["repeats", "step ms"], [[r["repeats"], t.timed_col(r, "step_ms", 1)] for r in rows])

    RESULTS = t.Results("watchdog", t.Section("HangWatchdog: what it costs", t.Table(watchdog, ("step_ms",))))

``experiments/run_all.py`` finds every script with a ``RESULTS`` (its name is the experiment's, for
``--only``), runs them and builds the page's block from their sections; ``tests/test_run_all.py`` reads
each table's key columns (changing any of them must change the table) and whether it shows timings.

A table shows CSV values, or medians / minima / maxima / counts of a CSV column, or byte counts in MiB:
``tests/test_run_all.py`` checks every number. Every timing goes through :func:`timed` (median and
min-max range; the test checks that each timing column has its range), and a ratio's cell ends with
``_harness.verdict``'s words ("within noise" when its range crosses parity or the goal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import _harness as h

Rows = list[dict[str, str]]


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def fixed(value: str | float, digits: int) -> str:
    """``value`` with ``digits`` decimals."""
    return f"{float(value):.{digits}f}"


def groups(rows: Rows, key: str) -> dict[str, Rows]:
    """The rows by their value of ``key``, in first-seen order."""
    out: dict[str, Rows] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def mib(value: float) -> str:
    """Bytes as MiB, one decimal."""
    return fixed(value / 2**20, 1)


def timed(median: str | float, lo: str | float, hi: str | float, digits: int, verdict: str = "") -> str:
    """A timing cell: the median, its min-max range over the repeats, and the verdict if any.

    Every timing in the block goes through here (``tests/test_run_all.py`` checks that each timing
    column has its range).
    """
    cell = f"{fixed(median, digits)} ({fixed(lo, digits)} .. {fixed(hi, digits)})"
    return f"{cell}, {verdict}" if verdict else cell


def timed_col(row: dict[str, str], key: str, digits: int, verdict: str = "") -> str:
    """:func:`timed` of the CSV columns ``key``, ``key_min``, ``key_max`` of one row."""
    return timed(row[key], row[f"{key}_min"], row[f"{key}_max"], digits, verdict)


def timed_rows(rows: Rows, key: str, digits: int, verdict: str = "") -> str:
    """:func:`timed` of one column over per-repeat rows: their median and range."""
    s = h.spread(float(r[key]) for r in rows)
    return timed(s.median, s.lo, s.hi, digits, verdict)


def ratio_verdict(row: dict[str, str], key: str, **kw: object) -> str:
    """``_harness.verdict``'s words for the range of the CSV columns ``key_min`` .. ``key_max``."""
    return h.verdict(float(row[f"{key}_min"]), float(row[f"{key}_max"]), **kw)


def groups_of(rows: Rows, keys: tuple[str, ...]) -> dict[tuple[str, ...], Rows]:
    """The rows by their values of ``keys``, in first-seen order."""
    out: dict[tuple[str, ...], Rows] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


# ---------------------------------------------------------------------- what an experiment declares


@dataclass(frozen=True)
class Table:
    """One table of the page: ``build`` turns the rows of the CSV named after it into markdown.

    ``key_columns``: the CSV columns whose every change must change the table (``tests/test_run_all.py``
    changes each); ``timed``: it shows timings, each with its range (the test checks it recognises them).
    The plot of the CSV, when there is one, is the PNG of the same name, linked under the table.
    """

    build: Callable[[Rows], str]
    key_columns: tuple[str, ...]
    timed: bool = False

    @property
    def name(self) -> str:
        """The CSV's name, without ``.csv``: the function's."""
        return self.build.__name__


@dataclass(frozen=True)
class Section:
    """One section of docs/results.md: its title and its tables."""

    title: str
    tables: tuple[Table, ...]

    def __init__(self, title: str, *tables: Table) -> None:
        object.__setattr__(self, "title", title)
        object.__setattr__(self, "tables", tables)


@dataclass(frozen=True)
class Results:
    """What docs/results.md shows of one experiment: its name (``run_all.py --only NAME``) and sections.

    A script declares it as ``RESULTS``; ``run_all.py`` finds it there.
    """

    experiment: str
    sections: tuple[Section, ...]

    def __init__(self, experiment: str, *sections: Section) -> None:
        object.__setattr__(self, "experiment", experiment)
        object.__setattr__(self, "sections", sections)
