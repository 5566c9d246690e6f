"""Time the job's own links: each collective, a send/recv and a host copy at several message sizes.

What the planner's time model reads its communication curves from (``planner/links.py`` interpolates
them): each kind of message (:data:`KINDS`) is timed at every size of ``sizes``, the kinds and sizes
interleaved and repeated after a warm-up; the median of the repeats is kept with the fastest and the
slowest (the spread): a message's typical time on the group as it is now, the wake-up of a busy peer
included (every message of a plan pays it, unlike a compute disturbance that the fastest of a few runs
leaves out). Also timed: how much a collective and compute slow each other when they run at once
(:class:`OverlapTiming`: the overlap of a gradient reduction with the backward).

:func:`time_group` runs on every rank of a process group (it is collective) and hands every rank rank
0's timings; :func:`time_loopback` times two gloo ranks in threads of this process over loopback, for a
planner that runs without a job (the command line). Pure PyTorch (no Lightning import).
"""

from __future__ import annotations

import datetime
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.agree import collective_device, world_size

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24)
"""Message sizes timed by default, in bytes: 1 KiB to 16 MiB, 16x apart (4 KiB apart on a log scale)."""

REPEATS = 5
"""Timed repeats of each message (after one warm-up); the median is kept."""

KINDS = ("send", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
"""The messages timed over the group, each of ``size`` bytes in all: a send from the first rank to the
second (and a one-element acknowledgement back); an all-reduce of a ``size`` tensor; an all-gather into a
``size`` tensor; a reduce-scatter of a ``size`` tensor; an all-to-all of a ``size`` tensor per rank; a
broadcast of a ``size`` tensor from the first rank."""


@dataclass(frozen=True)
class Timed:
    """One kind of message: at each size, the median seconds of the repeats, the fastest and the slowest.

    Example::

        >>> t = Timed((1024, 4096), (1e-4, 2e-4), (9e-5, 1.5e-4), (2e-4, 3e-4))
        >>> round(t.spread, 2)     # the widest (slowest - fastest) / median over the sizes
        1.1
    """

    sizes: tuple[int, ...]
    median: tuple[float, ...]
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    @property
    def spread(self) -> float:
        """The widest spread over the sizes, relative to the median (0: every repeat alike)."""
        pairs = zip(self.low or self.median, self.high or self.median, self.median)
        return max(((hi - lo) / m if m > 0 else 0.0 for lo, hi, m in pairs), default=0.0)


@dataclass(frozen=True)
class OverlapTiming:
    """A collective launched asynchronously while the rank computes, against each alone (seconds).

    ``slowdown`` is what the pair costs beyond perfect overlap: while both run, each progresses at
    ``1 / slowdown`` of its speed alone, so running ``c`` seconds of compute and ``m`` of communication
    together takes ``max(c, m) + (slowdown - 1) min(c, m)``: 1 when they hide each other perfectly, 2
    when they run one after the other (gloo's threads and the compute sharing the same cores).

    Example::

        >>> OverlapTiming(compute=0.010, collective=0.008, together=0.014).slowdown
        1.5
    """

    compute: float
    collective: float
    together: float

    @property
    def slowdown(self) -> float:
        shorter, longer = sorted((self.compute, self.collective))
        if shorter <= 0:
            return 1.0
        return min(2.0, max(1.0, 1.0 + (self.together - longer) / shorter))


@dataclass(frozen=True)
class LinkTimings:
    """Every kind of message timed on a group of ``ranks`` (:data:`KINDS`, and ``"copy"``: host to device
    and back, halved), and the overlap of a collective with compute (``None``: not timed).

    Example::

        timings = time_group()                   # on every rank of the job
        timings.timed["all_reduce"].median[-1]   # seconds for a 16 MiB all-reduce over every rank
    """

    ranks: int
    where: str
    timed: dict[str, Timed] = field(default_factory=dict)
    overlap: OverlapTiming | None = None


def time_group(
    group: Any | None = None,
    sizes: tuple[int, ...] = SIZES,
    repeats: int = REPEATS,
    device: torch.device | None = None,
    overlap: bool = True,
) -> LinkTimings | None:
    """Time every kind of message over ``group`` at each size, host copies to ``device``, and the overlap
    of a collective with compute; ``None`` without a group of two ranks or more.

    Every rank of ``group`` calls it; every rank returns the first rank's timings.

    Example::

        timings = time_group(sizes=(1 << 10, 1 << 20), repeats=3)    # a cheap probe (tests)
    """
    ranks = world_size(group)
    if ranks < 2:
        return None
    where = collective_device(group)
    me = dist.get_rank(group)
    first, second = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))
    peer = second if me == 0 else first
    ops = _group_ops(sizes, ranks, where, group, peer, me)
    ops["copy"] = [_copy_op(size, device or where) for size in sizes]
    timed = _interleaved(ops, sizes, repeats, where)
    found = None
    if overlap:
        found = _overlap(lambda t: dist.all_reduce(t, group=group, async_op=True), sizes[-1], repeats, where)
    box = [(timed, found)]
    dist.broadcast_object_list(box, src=first, group=group)
    backend = dist.get_backend(group)
    return LinkTimings(ranks, f"measured on the job's group ({backend}, {ranks} ranks)", *box[0])


def _group_ops(
    sizes: tuple[int, ...], ranks: int, device: torch.device, group: Any, peer: int, me: int
) -> dict[str, list[Callable[[], Any]]]:
    """Per kind of message, one call per size (on this rank of ``group``)."""
    ops: dict[str, list[Callable[[], Any]]] = {kind: [] for kind in KINDS}
    for size in sizes:
        whole, part = _floats(size, device), _floats(max(size // ranks, 4), device)
        gathered = _floats(4 * (part.numel() * ranks), device)
        ops["send"].append(lambda t=whole: _ping(t, peer, me == 0, group) if me < 2 else None)
        ops["all_reduce"].append(lambda t=whole: dist.all_reduce(t, group=group))
        ops["all_gather"].append(lambda o=gathered, i=part: dist.all_gather_into_tensor(o, i, group=group))
        ops["reduce_scatter"].append(lambda o=part, i=gathered: dist.reduce_scatter_tensor(o, i, group=group))
        spread = gathered.clone()
        ops["all_to_all"].append(lambda o=spread, i=gathered: dist.all_to_all_single(o, i, group=group))
        source = dist.get_global_rank(group, 0) if group is not None else 0
        ops["broadcast"].append(lambda t=whole, s=source: dist.broadcast(t, s, group=group))
    return ops


def _floats(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.ones(max(1, nbytes // 4), device=device)


def _ping(t: torch.Tensor, peer: int, sending: bool, group: Any) -> None:
    """One message there and a small acknowledgement back, so the sender sees the whole transfer."""
    ack = torch.zeros(1, device=t.device)
    if sending:
        dist.send(t, peer, group=group)
        dist.recv(ack, peer, group=group)
    else:
        dist.recv(t, peer, group=group)
        dist.send(ack, peer, group=group)


def _copy_op(nbytes: int, device: torch.device) -> Callable[[], None]:
    """A copy of ``nbytes`` from the host to ``device`` and back (halved by :func:`_interleaved`)."""
    pin = device.type == "cuda"
    host = torch.ones(max(1, nbytes // 4), pin_memory=pin)
    there = torch.empty_like(host, device=device)

    def both() -> None:
        there.copy_(host, non_blocking=pin)
        host.copy_(there, non_blocking=pin)

    return both


def time_loopback(sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS) -> LinkTimings:
    """Time two gloo ranks in threads of this process, over loopback (no job, no process group needed),
    and host copies; no overlap (the threads share one interpreter).

    Example::

        time_loopback().timed["send"].median      # seconds per send at each size, on this machine
    """
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    found: dict[int, dict[str, Timed]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            mine = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False)
            pg = dist.ProcessGroupGloo(dist.PrefixStore("links", mine), r, 2, datetime.timedelta(seconds=60))
            found[r] = _interleaved(_loopback_ops(pg, sizes, r), sizes, repeats)
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if errors or 0 not in found:
        raise RuntimeError(f"could not time loopback links: {errors[0] if errors else 'timed out'}")
    copies = _interleaved({"copy": [_copy_op(s, torch.device("cpu")) for s in sizes]}, sizes, repeats)
    return LinkTimings(2, "measured on loopback (gloo, 2 ranks)", found[0] | copies)


def _loopback_ops(pg: Any, sizes: tuple[int, ...], r: int) -> dict[str, list[Callable[[], Any]]]:
    ops: dict[str, list[Callable[[], Any]]] = {kind: [] for kind in KINDS}
    for size in sizes:
        whole, part = _floats(size, torch.device("cpu")), _floats(max(size // 2, 4), torch.device("cpu"))
        gathered = torch.ones(2 * part.numel())
        ops["send"].append(lambda t=whole: _pg_ping(pg, t, 1 - r, r == 0))
        ops["all_reduce"].append(lambda t=whole: pg.allreduce([t]).wait())
        ops["all_gather"].append(lambda o=gathered, i=part: pg._allgather_base(o, i).wait())
        ops["reduce_scatter"].append(lambda o=part, i=gathered: pg._reduce_scatter_base(o, i).wait())
        spread = gathered.clone()
        ops["all_to_all"].append(lambda o=spread, i=gathered: pg.alltoall_base(o, i, [], []).wait())
        ops["broadcast"].append(lambda t=whole: pg.broadcast([t], dist.BroadcastOptions()).wait())
    return ops


def _pg_ping(pg: Any, t: torch.Tensor, peer: int, sending: bool) -> None:
    ack = torch.zeros(1)
    if sending:
        pg.send([t], peer, 0).wait()
        pg.recv([ack], peer, 1).wait()
    else:
        pg.recv([t], peer, 0).wait()
        pg.send([ack], peer, 1).wait()


def time_copy(nbytes: int = 1 << 24, device: torch.device | None = None, repeats: int = 3) -> float:
    """Seconds to copy ``nbytes`` from the host to ``device`` and back, halved (one direction).

    On a CPU-only machine the device is the host: the figure is a memory copy.

    Example::

        time_copy(1 << 24)      # seconds for 16 MiB one way
    """
    device = device or torch.device("cpu")
    return _typical(_copy_op(nbytes, device), repeats, device) / 2


def _interleaved(
    ops: dict[str, list[Callable[[], Any]]],
    sizes: tuple[int, ...],
    repeats: int,
    device: torch.device | None = None,
) -> dict[str, Timed]:
    """Each kind's calls (one per size) run in turn, ``repeats`` times after a warm-up: a burst of other
    work on the machine falls on every kind and size alike, not on one of them. Copies are halved (there
    and back)."""
    samples = {kind: [[] for _ in calls] for kind, calls in ops.items()}
    for repeat in range(repeats + 1):
        for kind, calls in ops.items():
            for i, fn in enumerate(calls):
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                if repeat:
                    samples[kind][i].append((time.perf_counter() - start) / (2 if kind == "copy" else 1))
    return {
        kind: Timed(
            tuple(sizes),
            tuple(statistics.median(s) for s in per_size),
            tuple(min(s) for s in per_size),
            tuple(max(s) for s in per_size),
        )
        for kind, per_size in samples.items()
    }


def _overlap(
    launch: Callable[[torch.Tensor], Any], nbytes: int, repeats: int, device: torch.device
) -> OverlapTiming:
    """The collective (``launch`` returns its work) of ``nbytes``, compute of about as long, and both at
    once: the median of each over ``repeats`` after a warm-up. Every rank runs the same calls."""
    message = _floats(nbytes, device)
    a = torch.randn(128, 128, device=device)

    def collective() -> None:
        launch(message).wait()

    alone = _typical(collective, repeats, device)
    matmul = _typical(lambda: a @ a, repeats, device)
    n = max(1, min(10_000, round(alone / max(matmul, 1e-7))))

    def compute() -> None:
        for _ in range(n):
            a @ a

    def both() -> None:
        work = launch(message)
        compute()
        work.wait()

    return OverlapTiming(_typical(compute, repeats, device), alone, _typical(both, repeats, device))


def _typical(fn: Callable[[], Any], repeats: int, device: torch.device | None = None) -> float:
    """The median seconds of ``fn`` over ``repeats`` runs after a warm-up."""
    samples = []
    for _ in range(repeats + 1):  # the first warms up
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = [
    "KINDS",
    "REPEATS",
    "SIZES",
    "LinkTimings",
    "OverlapTiming",
    "Timed",
    "time_copy",
    "time_group",
    "time_loopback",
]
