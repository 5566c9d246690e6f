"""Which samples a rank's batch holds, in a few numbers; the ranks of one pipeline compare them.

Every rank of a pipeline loads the batch from its own loader (the first stage reads the inputs, the
last the labels), so a sampler that splits the data over the world instead of the replicas trains on
mismatched pairs without any error. :func:`fingerprint` reduces a batch to one integer per part,
a position-weighted sum of each sample's bits (nothing is copied off the device), and
:func:`check_same_batch` gathers them (one small all-gather) and fails on every rank when the ranks
of a replica read different samples. Pure PyTorch (no Lightning import).

Random augmentation drawn differently on each rank changes floating-point parts only: when a part
that tells the samples apart (labels, token ids) agrees, a difference confined to floating-point parts
is reported as a warning, not an error (it is harmless for an input only the first stage reads).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.agree import agree, collective_device, distributed_ready

__all__ = ["BatchFingerprint", "Disagreement", "check_same_batch", "compare", "fingerprint"]

SLOTS = 16  # parts compared one by one; the rest are folded into the last two (exact, floating point)
_NAMED = SLOTS - 2
_WEIGHT = 1_000_003  # sample i counts (i * _WEIGHT + 1) times: the order of the samples matters too
_PRIMITIVES = (str, bytes, int, float, bool, type(None))

FIX = (
    "A sampler that splits the data over the world instead of the replicas does this: build it with "
    "DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs), or pass no sampler and "
    "let Lightning split the data; randomness in the data set or collate_fn (masking, cropping) must be "
    "drawn the same on every rank of a replica (seeded from the sample's index and the epoch)"
)


@dataclass(frozen=True)
class BatchFingerprint:
    """A batch as numbers the ranks can compare: its structure, and one digest per part (slot).

    ``exact[i]``: slot ``i`` holds integers, booleans or Python values (expected to agree whatever the
    augmentation); else floating-point tensors. ``telling[i]`` (a bool tensor): the slot's samples
    differ from each other (a constant part, an all-ones mask, tells no batch apart). The tensors stay
    where the batch is: reading them is left to the gather.

    Example::

        fp = fingerprint({"x": torch.randn(4, 3), "y": torch.arange(4)})
        fp.names, fp.exact    # ("batch['x']", "batch['y']"), (False, True)
    """

    structure: int
    names: tuple[str, ...]
    exact: tuple[bool, ...]
    telling: torch.Tensor  # bool, one per slot
    digests: torch.Tensor  # int64, one per slot

    def row(self, replica: int, pipeline_rank: int, device: torch.device) -> torch.Tensor:
        """What one rank contributes to the gather: where it sits, then the batch's numbers."""
        n = len(self.names)
        bits = (self.telling.to(device, torch.int64) << torch.arange(n, device=device)).sum().reshape(1)
        head = torch.tensor([replica, pipeline_rank, self.structure], dtype=torch.int64, device=device)
        digests = torch.zeros(SLOTS, dtype=torch.int64, device=device)
        digests[:n] = self.digests.to(device)
        return torch.cat([head, bits, digests])


def fingerprint(batch: Any) -> BatchFingerprint:
    """The fingerprint of ``batch`` (tensors, dicts, lists, tuples and Python values, nested)."""
    parts = list(_parts(batch, "batch"))
    shape = ";".join(f"{path}:{_describe(value)}" for path, value in parts)
    named, exact, telling, digests = [], [], [], []
    folded: dict[bool, list[Any]] = {True: [], False: []}
    for path, value in parts:
        digest = _digest(value)
        if digest is None:
            continue  # not comparable (an opaque object): its type is in the structure
        is_exact = not (torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()))
        if len(named) < _NAMED:
            named.append(path)
            exact.append(is_exact)
            telling.append(digest[1])
            digests.append(digest[0])
        else:
            folded[is_exact].append(digest)
    for is_exact in (True, False):
        if folded[is_exact]:
            named.append(f"{len(folded[is_exact])} more {'exact' if is_exact else 'floating-point'} parts")
            exact.append(is_exact)
            telling.append(_stacked([t for _, t in folded[is_exact]]).any())
            digests.append(_fold([d for d, _ in folded[is_exact]]))
    structure = zlib.crc32(shape.encode())
    return BatchFingerprint(structure, tuple(named), tuple(exact), _stacked(telling), _stacked(digests))


def _stacked(values: list[torch.Tensor]) -> torch.Tensor:
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    device = values[0].device
    return torch.stack([v.to(device) for v in values])


def _parts(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` of a nested batch; a list of Python values is one part (one value per sample)."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _parts(value[key], f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)) and not _all_primitive(value):
        for i, item in enumerate(value):
            yield from _parts(item, f"{path}[{i}]")
    else:
        yield path, value


def _all_primitive(values: Any) -> bool:
    return len(values) > 0 and all(isinstance(v, _PRIMITIVES) for v in values)


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        try:
            return f"{value.dtype}{tuple(value.shape)}"
        except Exception:  # a nested tensor has no single shape
            return f"{value.dtype}{type(value).__name__}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{len(value)}]"
    return type(value).__name__


def _digest(value: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(digest, whether its samples differ)`` (0-d tensors), or ``None`` for what cannot be compared."""
    if torch.is_tensor(value):
        try:
            return _tensor_digest(value.detach())
        except Exception:  # sparse, nested or meta tensors: their shape and dtype are compared
            return None
    if isinstance(value, _PRIMITIVES):
        return torch.tensor(_crc(value), dtype=torch.int64), torch.tensor(False)
    if isinstance(value, (list, tuple)):  # of Python values (_parts): one sample each
        return _sample_digest(torch.tensor([_crc(v) for v in value], dtype=torch.int64))
    return None


def _tensor_digest(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.resolve_conj().resolve_neg()  # (lazy views: no-ops for a batch as loaded)
    if x.is_complex():
        x = torch.view_as_real(x)
    # The bits as integers, summed with wrap-around: exact and independent of the reduction order,
    # so the same data gives the same number on every device.
    ints = x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    if ints.dim() == 0:
        return ints.to(torch.int64), torch.tensor(False, device=x.device)
    per_sample = ints.sum(dim=tuple(range(1, ints.dim())), dtype=torch.int64) if ints.dim() > 1 else ints
    return _sample_digest(per_sample.to(torch.int64))


def _sample_digest(per_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = per_sample.numel()
    weights = torch.arange(n, device=per_sample.device, dtype=torch.int64) * _WEIGHT + 1
    # One sample: nothing to compare it with, so it counts as telling (a batch of one label).
    telling = (per_sample != per_sample[:1]).any() | (n == 1)
    return (per_sample * weights).sum(), telling


def _fold(digests: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.int64, device=digests[0].device)
    for i, d in enumerate(digests):
        total = total + d.to(total.device) * (2 * i + 1)
    return total


def _crc(value: Any) -> int:
    return zlib.crc32(repr(value).encode())


@dataclass(frozen=True)
class Disagreement:
    """Two ranks of one replica that read different batches: which, where they differ, how bad.

    ``fatal``: different samples (an exact part, the structure, or every part that tells samples apart
    differs; or tensor-parallel ranks of one stage differ at all). Otherwise only floating-point parts
    differ while a telling part agrees: random augmentation drawn on each rank, most likely.
    """

    replica: int
    ranks: tuple[int, int]
    pipeline_ranks: tuple[int, int]
    parts: tuple[str, ...]
    fatal: bool

    def message(self, batch_idx: Any) -> str:
        (a, b), (pa, pb) = self.ranks, self.pipeline_ranks
        where = (
            f"the ranks of data-parallel replica {self.replica} read different training batches at batch "
            f"{batch_idx}: global rank {a} (pipeline rank {pa}) and global rank {b} (pipeline rank {pb}) "
            f"differ in {', '.join(self.parts)}"
        )
        if self.fatal:
            return (
                f"{where}. Every stage (and tensor-parallel rank) of a replica must read the same samples, "
                f"or the last stage pairs one sample's activations with another sample's labels. {FIX}"
            )
        return (
            f"{where}, the floating-point parts only, while the parts that tell samples apart agree: random "
            "augmentation drawn differently on each rank? Harmless for an input only the first stage "
            "reads; if a later stage reads it too (a reconstruction target), draw it the same on every "
            "rank of a replica (seeded from the sample's index and the epoch)"
        )


def compare(rows: list[list[int]], fp: BatchFingerprint) -> list[Disagreement]:
    """The disagreements among gathered :meth:`BatchFingerprint.row`s (one per global rank, in order).

    Each rank is compared with the lowest rank of its replica; ``fp`` (this rank's) names the parts.

    Example::

        rows = [fp.row(0, p, torch.device("cpu")).tolist() for p in range(2)]   # 2 stages, 1 replica
        compare(rows, fp)  # []
    """
    first: dict[int, int] = {}
    found = []
    for rank, row in enumerate(rows):
        ref = first.setdefault(row[0], rank)
        if ref != rank:
            found.extend(_compare_pair(rows, ref, rank, fp))
    return found


def _compare_pair(rows: list[list[int]], a: int, b: int, fp: BatchFingerprint) -> list[Disagreement]:
    ra, rb = rows[a], rows[b]
    pair = dict(replica=ra[0], ranks=(a, b), pipeline_ranks=(ra[1], rb[1]))
    if ra[2] != rb[2]:
        return [Disagreement(**pair, parts=("their structure (parts, shapes or dtypes)",), fatal=True)]
    n = len(fp.names)
    differ = [i for i in range(n) if ra[4 + i] != rb[4 + i]]
    if not differ:
        return []
    telling_agree = [i for i in range(n) if i not in differ and (ra[3] >> i) & 1]
    fatal = ra[1] == rb[1] or any(fp.exact[i] for i in differ) or not telling_agree
    return [Disagreement(**pair, parts=tuple(fp.names[i] for i in differ), fatal=fatal)]


def check_same_batch(batch: Any, replica: int, pipeline_rank: int, batch_idx: Any = None) -> list[str]:
    """Compare ``batch`` over all ranks; raise on every rank if the ranks of a replica hold different samples.

    Call it on every rank at the same point: one all-gather of ``4 + SLOTS`` integers per rank, then
    one agreement (:func:`~lightning_parallel.distributed.agree.agree`), so a failure to fingerprint on
    one rank also stops all. Returns the warnings (floating-point parts only differ), the same on every rank.

    Raises:
        ValueError: on every rank, naming the replica, the ranks, the parts that differ and the fix.

    Example::

        warnings = check_same_batch(batch, replica=mesh.rank("data"), pipeline_rank=mesh.pp_rank, batch_idx=0)
    """
    device = collective_device()
    error: BaseException | None = None
    try:
        fp = fingerprint(batch)
        row = fp.row(replica, pipeline_rank, device)
    except Exception as err:
        error, fp = err, fingerprint(None)
        row = fp.row(replica, pipeline_rank, device)
    rows = [row.tolist()]
    if distributed_ready() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, row)
        rows = [g.tolist() for g in gathered]
    found = compare(rows, fp) if error is None else []
    fatal = [d for d in found if d.fatal]
    if error is None and fatal:
        extra = f" ({len(fatal) - 1} more pairs of ranks differ)" if len(fatal) > 1 else ""
        error = ValueError(fatal[0].message(batch_idx) + extra)
    agree(error)
    return [d.message(batch_idx) for d in found]
