"""Coalesced scalar reduction, key-set agreement and object broadcast over a process group.

Pure PyTorch (no Lightning import). :class:`ScalarReducer` reduces any number of named scalars
``(value, weight, op)`` in **one** ``all_gather`` per call once the ranks agree on the key set; the set
is re-agreed (one extra object gather) only when some rank brings a key the others have not seen.
Every decision that follows the collective (which ranks logged a key, whether the reductions agree,
whether a value is finite) is taken from the gathered tensor, which is the same on every rank, so
every rank raises the same error or none does: no rank is ever left waiting in a collective.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.agree import distributed_ready, world_size

__all__ = [
    "REDUCE_OPS",
    "Reduced",
    "ScalarReducer",
    "agree_keys",
    "all_gather_objects",
    "broadcast_object",
    "distributed_ready",
    "gather_object_to",
    "match_reduce_op",
    "min_over_ranks",
    "recv_object",
    "send_object",
    "validate_reduce_map",
]

REDUCE_OPS: tuple[str, ...] = ("mean", "sum", "max", "min")
"""Cross-rank reductions: ``mean`` is weighted by each rank's weight (its sample count)."""

_OP_CODE = {op: float(i + 1) for i, op in enumerate(REDUCE_OPS)}
_CODE_OP = {code: op for op, code in _OP_CODE.items()}
_HEADER = 2  # [some rank has a key outside the layout, hash of this rank's layout]
_STRIDE = 4  # per key: [present, op code, value * weight (mean) or value, weight]


def _world(group: Any | None) -> int:
    return world_size(group)


def barrier(group: Any | None = None) -> None:
    """Wait for every rank of ``group`` (a no-op without a process group)."""
    if _world(group) > 1:
        dist.barrier(group=group)


def all_gather_objects(obj: Any, group: Any | None = None) -> list[Any]:
    """Every rank's ``obj``, by rank in ``group`` (``[obj]`` without a process group)."""
    if _world(group) == 1:
        return [obj]
    out: list[Any] = [None] * _world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any | None = None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (``obj`` itself without a process group)."""
    if _world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object_to(obj: Any, dst: int, group: Any | None = None) -> list[Any] | None:
    """Every rank's ``obj`` on global rank ``dst`` (by rank in ``group``); ``None`` on the other ranks."""
    if _world(group) == 1:
        return [obj]
    out: list[Any] | None = [None] * _world(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def send_object(obj: Any, dst: int, group: Any | None = None) -> None:
    """Send a picklable ``obj`` to global rank ``dst`` (matched by :func:`recv_object` there)."""
    dist.send_object_list([obj], dst=dst, group=group)


def recv_object(src: int, group: Any | None = None) -> Any:
    """Receive the object global rank ``src`` sends with :func:`send_object`."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def agree_keys(keys: Iterable[str], group: Any | None = None) -> list[str]:
    """The sorted union of every rank's ``keys``: one object gather, the same list on every rank."""
    union: set[str] = set()
    for rank_keys in all_gather_objects(sorted(set(keys)), group):
        union.update(rank_keys)
    return sorted(union)


def validate_reduce_map(reduce: Mapping[str, str] | None) -> dict[str, str]:
    """Check a ``{metric name or glob: reduction}`` map; return it with lower-case reductions.

    Raises:
        TypeError: ``reduce`` is not a mapping of strings to strings.
        ValueError: a reduction is not one of :data:`REDUCE_OPS`.
    """
    if reduce is None:
        return {}
    if not isinstance(reduce, Mapping):
        raise TypeError(f"reduce must be a dict of metric name (or glob) -> reduction, got {type(reduce)}")
    out = {}
    for pattern, op in reduce.items():
        if not isinstance(pattern, str) or not isinstance(op, str):
            raise TypeError(f"reduce entries must be str -> str, got {pattern!r}: {op!r}")
        if op.lower() not in REDUCE_OPS:
            raise ValueError(f"unknown reduction {op!r} for {pattern!r}: use one of {', '.join(REDUCE_OPS)}")
        out[pattern] = op.lower()
    return out


def match_reduce_op(name: str, reduce: Mapping[str, str], default: str) -> str:
    """The reduction of ``name``: an exact key of ``reduce`` first, then the first glob that matches."""
    if name in reduce:
        return reduce[name]
    for pattern, op in reduce.items():
        if fnmatch.fnmatchcase(name, pattern):
            return op
    return default


def _layout_hash(layout: list[str]) -> float:
    digest = hashlib.blake2b("\0".join(layout).encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") % (1 << 52))  # exact in float64


@dataclass(frozen=True)
class Reduced:
    """One reduced key: its value over the ranks that had it, and those ranks (indices in the group)."""

    value: float
    ranks: tuple[int, ...]


class ScalarReducer:
    """Reduce many named scalars over a process group in one collective.

    Each call passes ``{key: (value, weight, op)}`` with ``op`` in :data:`REDUCE_OPS`. The result holds,
    for every key that at least one rank passed, the reduction over the ranks that passed it: ``mean``
    is ``sum(value * weight) / sum(weight)``; an entry with weight 0 counts as absent (a rank with an
    empty batch). All keys travel in one ``all_gather`` of a float64 vector (4 numbers per key), laid
    out by a key list the ranks agreed on; a rank that brings a new key makes every rank re-agree the
    list first (one ``all_gather_object``), which happens only when the key set changes.

    Args:
        group: process group (``None``: the default group).
        device: where the gathered vector lives (``cuda`` for NCCL); CPU by default.
        allow_nonfinite: reduce NaN/inf like any number instead of raising.
        label: how error messages name a key (the key itself by default).

    Raises (from :meth:`reduce`, identically on every rank):
        ValueError: an op is unknown, a key has different ops on different ranks, or a value is not finite.

    Example::

        reducer = ScalarReducer()
        out = reducer.reduce({"loss": (0.5, 32, "mean"), "tokens": (4096, 1, "sum")})
        out["loss"].value  # the sample-weighted mean over every rank
    """

    def __init__(
        self,
        group: Any | None = None,
        device: torch.device | str | None = None,
        allow_nonfinite: bool = False,
        label: Callable[[str], str] | None = None,
    ) -> None:
        self.group = group
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.allow_nonfinite = allow_nonfinite
        self.label = label or repr
        self.layout: list[str] = []
        self.collectives = 0  # tensor gathers plus key-set agreements, for tests and benchmarks
        self.agreements = 0

    def reduce(self, entries: Mapping[str, tuple[float, float, str]]) -> dict[str, Reduced]:
        """Reduce ``entries`` over the group; see the class docstring. Call it on every rank."""
        bad = sorted(k for k, (_, _, op) in entries.items() if op not in _OP_CODE)
        gathered = self._gather(entries, bad)
        if gathered[:, 0].max().item() > 0:
            self.layout = agree_keys(entries, self.group)
            self.agreements += 1
            self.collectives += 1
            gathered = self._gather(entries, bad)
        return self._finish(gathered)

    def _gather(self, entries: Mapping[str, tuple[float, float, str]], bad: list[str]) -> torch.Tensor:
        index = {k: i for i, k in enumerate(self.layout)}
        new = any(k not in index for k in entries) or bool(bad)
        vec = torch.zeros(_HEADER + _STRIDE * len(self.layout), dtype=torch.float64)
        vec[0], vec[1] = float(new), _layout_hash(self.layout)
        for key, (value, weight, op) in entries.items():
            if key not in index or weight == 0:
                continue
            base = _HEADER + _STRIDE * index[key]
            value, weight = float(value), float(weight)
            a = value * weight if op == "mean" else value
            vec[base : base + _STRIDE] = torch.tensor([1.0, _OP_CODE.get(op, -1.0), a, weight])
        if bad:
            vec[0] = 2.0  # unknown op: reported after the gather, like every other problem
        self.collectives += 1
        if _world(self.group) == 1:
            return vec.unsqueeze(0)
        vec = vec.to(self.device)
        out = [torch.empty_like(vec) for _ in range(_world(self.group))]
        dist.all_gather(out, vec, group=self.group)
        return torch.stack(out).cpu()

    def _finish(self, gathered: torch.Tensor) -> dict[str, Reduced]:
        problems = _header_problems(gathered)
        result: dict[str, Reduced] = {}
        for i, key in enumerate(self.layout):
            cols = gathered[:, _HEADER + _STRIDE * i : _HEADER + _STRIDE * (i + 1)]
            ranks = tuple(int(r) for r in torch.nonzero(cols[:, 0] > 0).flatten())
            if ranks:
                value, problem = _reduce_key(self.label(key), cols[list(ranks)], ranks, self.allow_nonfinite)
                problems.extend(problem)
                result[key] = Reduced(value, ranks)
        if problems:
            raise ValueError("metric synchronisation failed on every rank:\n  " + "\n  ".join(problems))
        return result

    def reset_layout(self) -> None:
        """Forget the agreed key list (call it on every rank at the same point, e.g. an epoch end).

        Keys that nobody passes stay in the layout until then, so that a key logged every other step
        does not make the ranks re-agree the list at every step.
        """
        self.layout = []


def _header_problems(gathered: torch.Tensor) -> list[str]:
    problems = []
    if (gathered[:, 0] == 2.0).any():
        ranks = torch.nonzero(gathered[:, 0] == 2.0).flatten().tolist()
        problems.append(f"ranks {ranks} passed an unknown reduction: use one of {', '.join(REDUCE_OPS)}")
    if (gathered[:, 1] != gathered[0, 1]).any():
        problems.append("the ranks disagree on the key layout (internal error: please report it)")
    return problems


def _reduce_key(
    key: str, rows: torch.Tensor, ranks: tuple[int, ...], allow_nonfinite: bool
) -> tuple[float, list[str]]:
    codes = sorted(set(rows[:, 1].tolist()))
    if len(codes) > 1:
        by_rank = ", ".join(f"rank {r}: {_CODE_OP.get(c, '?')}" for r, c in zip(ranks, rows[:, 1].tolist()))
        return math.nan, [
            f"{key} is reduced differently on different ranks ({by_rank}): "
            "log it with the same reduce_fx on every rank"
        ]
    a, w = rows[:, 2], rows[:, 3]
    bad = [r for r, ok in zip(ranks, torch.isfinite(a).tolist()) if not ok]
    if bad and not allow_nonfinite:
        vals = ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, a.tolist()) if r in bad)
        return math.nan, [f"{key} is not finite ({vals}): fix the value, or pass allow_nonfinite=True"]
    if codes[0] not in _CODE_OP:
        return math.nan, []  # an unknown op: reported by _header_problems
    op = _CODE_OP[codes[0]]
    if op == "mean":
        return float(a.sum() / w.sum()), []
    if op == "sum":
        return float(a.sum()), []
    return float(a.max() if op == "max" else a.min()), []


def min_over_ranks(
    values: list[float], group: Any | None = None, device: torch.device | str | None = None
) -> list[float]:
    """The element-wise minimum of ``values`` over the ranks of ``group`` (one ``all_reduce``).

    Every rank must pass a list of the same length (``inf`` stands for "unbounded").
    """
    if _world(group) == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.cpu().tolist()
