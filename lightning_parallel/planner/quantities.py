"""Sizes, rates and durations as people write them (``"24GiB"``, ``"25GB/s"``, ``"20us"``); the host's RAM."""

from __future__ import annotations

import os
import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_bytes(text: str | int) -> int:
    """``"24GiB"`` -> 25769803776; ``"1.5GB"``, ``"512MiB"``, ``"1000"`` (bytes) and ints also work.

    Example::

        >>> parse_bytes("2KiB")
        2048
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"a memory size must be positive, got {text}")
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the memory size {text!r}: write e.g. 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_rate(text: str) -> float:
    """Bytes per second from ``"25GB/s"`` (or ``"25GB"``).

    Example::

        >>> parse_rate("2KiB/s")
        2048.0
    """
    return float(parse_bytes(str(text).strip().removesuffix("/s")))


def parse_seconds(text: str) -> float:
    """Seconds from ``"20us"``, ``"1.5ms"``, ``"0.002s"`` or ``"0.002"``.

    Example::

        >>> parse_seconds("1.5ms")
        0.0015
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-z]*)\s*", str(text))
    if not match or match.group(2) not in (*_SECONDS, ""):
        raise ValueError(f"cannot read the duration {text!r}: write e.g. 20us, 1.5ms or 0.002s")
    return float(match.group(1)) * _SECONDS.get(match.group(2), 1.0)


def host_memory() -> int:
    """This machine's RAM in bytes (``os.sysconf``), the default host budget of a node."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
