"""Which group sizes can split a model's attention heads (Ulysses gives each rank heads/k of them)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["KV_HEADS", "QUERY_HEADS", "check_heads", "int_attr", "sizes_that_work"]

QUERY_HEADS = ("num_attention_heads", "num_heads", "n_head", "heads")
"""The names a Hugging Face config or a module gives its query heads (the first one set is read)."""
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "kv_heads")
"""The names of its key/value heads (none set: as many as the query heads)."""


def int_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``obj`` sets to a positive int, or None.

    Example::

        >>> int_attr(type("Config", (), {"num_heads": 4})(), QUERY_HEADS)
        4
    """
    for name in names:
        value = getattr(obj, name, None) if obj is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def sizes_that_work(query_heads: int, kv_heads: int | None = None) -> list[int]:
    """The sequence-parallel sizes that divide both head counts (the divisors of their gcd).

    Example::

        >>> sizes_that_work(32, 8)
        [1, 2, 4, 8]
    """
    common = math.gcd(query_heads, kv_heads if kv_heads is not None else query_heads)
    return [k for k in range(1, common + 1) if common % k == 0]


def check_heads(size: int, query_heads: int, kv_heads: int | None = None) -> None:
    """Refuse a group ``size`` that does not divide the query heads and the key/value heads.

    With grouped-query attention each rank takes ``kv_heads/k`` key/value heads and the ``query_heads/k``
    query heads that read them, so ``k`` must divide both.

    Raises:
        ValueError: naming the head counts and the sizes that work.

    Example::

        >>> check_heads(2, 4, 2)
        >>> check_heads(4, 4, 2)
        Traceback (most recent call last):
        ...
        ValueError: sequence_parallel_size=4 ... 4 query heads and 2 key/value heads: ... are 1, 2
    """
    kv = query_heads if kv_heads is None else kv_heads
    if query_heads % size == 0 and kv % size == 0:
        return
    heads = f"{query_heads} query heads and {kv} key/value heads" if kv != query_heads else f"{kv} heads"
    works = ", ".join(str(k) for k in sizes_that_work(query_heads, kv))
    raise ValueError(
        f"sequence_parallel_size={size} splits the attention heads over {size} ranks, but the attention "
        f"has {heads}: {size} must divide {'both' if kv != query_heads else 'them'}; the sizes that "
        f"work are {works}"
    )
