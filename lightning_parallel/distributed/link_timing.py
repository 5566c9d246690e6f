"""Time the job's own links: an all-reduce over the group and a send/recv between two of its ranks.

What the planner's time model reads its latency and bandwidth from (``memory/links.py`` fits them):
each of two message sizes is sent a few times after a warm-up and the median is kept: a message's
typical time on the group as it is now, the wake-up of a busy peer included (every message of a
plan pays it, unlike a compute disturbance that the fastest of a few runs leaves out).
:func:`time_group` runs on every rank of a process group (it is collective) and hands every rank rank
0's timings; :func:`time_loopback` times two gloo ranks in threads of this process over loopback, for a
planner that runs without a job (the command line).
Pure PyTorch (no Lightning import).
"""

from __future__ import annotations

import datetime
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.agree import collective_device, world_size

SIZES = (1 << 16, 1 << 22)  # bytes: 64 KiB and 4 MiB


@dataclass(frozen=True)
class LinkTimings:
    """Seconds per message for each size in ``sizes``: an all-reduce over ``ranks``, a send/recv of two.

    Example::

        timings = time_group()          # on every rank of the job
        timings.all_reduce[-1]          # seconds for a 4 MiB all-reduce over every rank
    """

    sizes: tuple[int, ...]
    ranks: int
    all_reduce: tuple[float, ...]
    send: tuple[float, ...]
    where: str


def time_group(
    group: Any | None = None, sizes: tuple[int, ...] = SIZES, repeats: int = 7
) -> LinkTimings | None:
    """Time an all-reduce over ``group`` and a send from its first rank to its second; ``None`` alone.

    Every rank of ``group`` calls it; every rank returns the first rank's timings.

    Example::

        timings = time_group()     # None without a process group or with one rank
    """
    ranks = world_size(group)
    if ranks < 2:
        return None
    device = collective_device(group)
    me = dist.get_rank(group)
    first, second = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))
    tensors = [torch.ones(size // 4, device=device) for size in sizes]
    peer = second if me == 0 else first
    reduces = [lambda t=t: dist.all_reduce(t, group=group) for t in tensors]
    sends = [lambda t=t: _ping(t, peer, me == 0, group) if me < 2 else None for t in tensors]
    box = [(_interleaved(reduces, repeats, device), _interleaved(sends, repeats, device))]
    dist.broadcast_object_list(box, src=first, group=group)
    backend = dist.get_backend(group)
    return LinkTimings(
        tuple(sizes), ranks, *box[0], f"measured on the job's group ({backend}, {ranks} ranks)"
    )


def _ping(t: torch.Tensor, peer: int, sending: bool, group: Any) -> None:
    """One message there and a small acknowledgement back, so the sender sees the whole transfer."""
    ack = torch.zeros(1, device=t.device)
    if sending:
        dist.send(t, peer, group=group)
        dist.recv(ack, peer, group=group)
    else:
        dist.recv(t, peer, group=group)
        dist.send(ack, peer, group=group)


def time_loopback(sizes: tuple[int, ...] = SIZES, repeats: int = 7) -> LinkTimings:
    """Time two gloo ranks in threads of this process, over loopback (no job, no process group needed).

    Example::

        time_loopback().send      # seconds per send of 64 KiB and of 4 MiB on this machine
    """
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    found: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            mine = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False)
            pg = dist.ProcessGroupGloo(dist.PrefixStore("links", mine), r, 2, datetime.timedelta(seconds=60))
            tensors = [torch.ones(size // 4) for size in sizes]
            reduces = [lambda t=t: pg.allreduce([t]).wait() for t in tensors]
            sends = [lambda t=t: _pg_ping(pg, t, 1 - r, r == 0) for t in tensors]
            found[r] = (_interleaved(reduces, repeats), _interleaved(sends, repeats))
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if errors or 0 not in found:
        raise RuntimeError(f"could not time loopback links: {errors[0] if errors else 'timed out'}")
    return LinkTimings(tuple(sizes), 2, *found[0], "measured on loopback (gloo, 2 ranks)")


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
    pin = device.type == "cuda"
    host = torch.ones(nbytes // 4, pin_memory=pin)
    there = torch.empty(nbytes // 4, device=device)

    def both() -> None:
        there.copy_(host, non_blocking=pin)
        host.copy_(there, non_blocking=pin)

    return _typical(both, repeats, device) / 2


def _interleaved(
    fns: list[Callable[[], Any]], repeats: int, device: torch.device | None = None
) -> tuple[float, ...]:
    """The median seconds of each of ``fns``, run in turn ``repeats`` times after a warm-up: a burst of
    other work on the machine falls on every message size alike, not on one of them."""
    samples: list[list[float]] = [[] for _ in fns]
    for repeat in range(repeats + 1):
        for i, fn in enumerate(fns):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if repeat:
                samples[i].append(time.perf_counter() - start)
    return tuple(statistics.median(s) for s in samples)


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


__all__ = ["SIZES", "LinkTimings", "time_copy", "time_group", "time_loopback"]
