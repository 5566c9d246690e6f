"""FSDP2's in-place measurement (``techniques/fsdp/timing.py``): what each timed piece holds."""

from __future__ import annotations

import torch

from lightning_parallel.techniques.fsdp import timing
from lightning_parallel.techniques.ledgers import TimeBench


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeSharded:
    """Each call advances the clock by a known amount: an all-gather 1 s, a forward 2 s (its backward 0)."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def unshard(self) -> None:
        self.clock.now += 1.0

    def reshard(self) -> None:
        pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 2.0
        return x * 2


def test_each_piece_is_timed_without_the_barrier_that_lines_the_ranks_up(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)

    def finish(sharded, reduce):
        clock.now += 8.0 if reduce else 4.0

    monkeypatch.setattr(timing, "finish_backward", finish)

    def barrier() -> None:  # a slow barrier (the ranks' skew): in no piece
        clock.now += 100.0

    bench = TimeBench(ranks=2, device=torch.device("cpu"), repeats=2, sync=barrier)
    x = torch.ones(3, requires_grad=True)
    pieces = timing._sharded_step(_FakeSharded(clock), (x,), {}, bench)
    # the all-gather, a forward, a forward and backward, the end of the backward, the reduce-scatter
    assert pieces == (1.0, 2.0, 2.0, 4.0, 8.0)
