"""Plain-text tables for the plans printed at start (stage plan, accumulation plan), and byte counts."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "<") -> str:
    """Columns padded to their widest cell, a rule under the headers; ``align`` is ``"<"`` or ``">"``.

    Example::

        >>> print(format_table(["stage", "layers"], [["0", "0-3"]]))
        stage  layers
        -----  ------
        0      0-3
    """
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:{align}{w}}}" for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in out)


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps 1-4 digits before the point.

    Example::

        >>> format_bytes(3 * 2**30)
        '3.00 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
