"""FSDP2's in-place measurement (``techniques/fsdp/timing.py``): what each timed piece holds."""

from __future__ import annotations

import time

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
        self.flags = {"last": True, "reshard": True, "sync": True}
        self.seen: list[dict[str, bool]] = []

    def set_is_last_backward(self, value: bool) -> None:
        self.flags["last"] = value

    def set_reshard_after_backward(self, value: bool) -> None:
        self.flags["reshard"] = value

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.flags["sync"] = value

    def unshard(self) -> None:
        self.clock.now += 1.0

    def reshard(self) -> None:
        pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 2.0
        self.seen.append(dict(self.flags))
        return x * 2


def test_each_piece_is_timed_without_the_barrier_that_lines_the_ranks_up(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)  # (the TimeBench's span reads it)

    def finish(sharded, reduce):
        clock.now += 8.0 if reduce else 4.0
        sharded.flags = {"last": True, "reshard": True, "sync": reduce}  # (as finish_backward leaves them)

    monkeypatch.setattr(timing, "finish_backward", finish)

    def barrier() -> None:  # a slow barrier (the ranks' skew): in no piece
        clock.now += 100.0

    bench = TimeBench(ranks=2, device=torch.device("cpu"), repeats=2, sync=barrier)
    x = torch.ones(3, requires_grad=True)
    sharded = _FakeSharded(clock)
    pieces = timing._sharded_step(sharded, (x,), {}, bench)
    # the all-gather, a forward, a forward and backward, the end of the backward, the reduce-scatter
    assert pieces == (1.0, 2.0, 2.0, 4.0, 8.0)
    # Every forward (and so its backward) as a stage runs a micro-batch's: not the last backward, no
    # reshard after it, no gradient sync; the window's end is the end piece's (finish_backward).
    assert sharded.seen == [{"last": False, "reshard": False, "sync": False}] * (2 * (bench.repeats + 1))
