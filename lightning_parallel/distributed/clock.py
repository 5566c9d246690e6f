"""Each rank's clock against rank 0's: what a job-wide timeline needs to put ranks on one time axis."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.distributed.collectives import all_gather_objects


def clock_offsets(device: Any = "cpu", rounds: int = 8, same_host_clock: bool = True) -> list[int]:
    """On global rank 0: each rank's clock minus rank 0's, in ns (zeros elsewhere; a collective).

    Ranks on rank 0's host share its clock (``perf_counter_ns`` reads the system-wide monotonic
    clock): their offset is 0, exactly (unless ``same_host_clock=False``). For each other rank, rank 0
    sends to it and gets its clock reading back, ``rounds`` times; the round trip with the shortest
    time gives the estimate (the reading taken half-way through it), good to about half that round
    trip (its asymmetry: a millisecond over gloo on a loaded host).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    hosts = all_gather_objects(socket.gethostname())
    offsets = [0] * world
    box = torch.zeros(1, dtype=torch.int64, device=device)
    for peer in range(1, world):
        if same_host_clock and hosts[peer] == hosts[0]:
            continue
        best: tuple[int, int] | None = None  # (round trip, offset)
        for _ in range(rounds):
            if rank == 0:
                sent = time.perf_counter_ns()
                dist.send(box, dst=peer)
                dist.recv(box, src=peer)
                back = time.perf_counter_ns()
                estimate = (back - sent, int(box.item()) - (sent + back) // 2)
                best = estimate if best is None or estimate[0] < best[0] else best
            elif rank == peer:
                dist.recv(box, src=0)
                box.fill_(time.perf_counter_ns())
                dist.send(box, dst=0)
        if rank == 0 and best is not None:
            offsets[peer] = best[1]
    return offsets
