"""Recomputation timed in place (``techniques/recompute/timing.py``): what torch's checkpoint adds to a
block's forward and backward, and what a recomputed unit is charged from it."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import SequentialRegressor
from torch import nn

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import given_links
from lightning_parallel.planner.time_model import step_time
from lightning_parallel.techniques.ledgers import Line, TimeBench, UnitSample
from lightning_parallel.techniques.recompute import TECHNIQUE
from lightning_parallel.techniques.recompute import timing as recompute_timing

CLOCK = [0.0]  # (module-level: the measurement times a deep copy of the block, not the block)


class _Ticking(nn.Module):
    """A block whose every forward (the recomputed one too) moves the fake clock by one second."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        CLOCK[0] += 1.0
        return torch.tanh(self.linear(x))


def test_the_forward_run_again_in_backward_is_measured_once_a_backward(monkeypatch):
    """On a fake clock only the block's forward moves (1 s each), so checkpointing adds nothing to the
    forward and exactly one forward (1 s, 1x the plain forward) to the backward."""
    monkeypatch.setattr(time, "perf_counter", lambda: CLOCK[0])  # (the TimeBench's span reads it)
    inputs = {n: ((torch.randn(n, 4, requires_grad=True),), {}) for n in (2, 8)}
    bench = TimeBench(
        ranks=1, device=torch.device("cpu"), samples=[UnitSample("b", _Ticking(), inputs)], repeats=1
    )
    times = TECHNIQUE.measure(bench)
    assert isinstance(times, recompute_timing.RecomputeTimes)
    for n in (2, 8):
        assert times.plain.at(n) == pytest.approx(1.0)
        assert times.factors(n) == pytest.approx((0.0, 1.0))
    frozen = _Ticking().requires_grad_(False)  # nothing to recompute for: not measured
    sample = UnitSample("f", frozen, {2: ((torch.randn(2, 4),), {})})
    assert TECHNIQUE.measure(TimeBench(ranks=1, device=torch.device("cpu"), samples=[sample])) is None


def test_a_recomputed_unit_pays_the_blocks_factors_at_its_own_forward():
    torch.manual_seed(0)
    model, batch = SequentialRegressor(d_in=16, hidden=64, depth=4), (torch.randn(8, 16), torch.randn(8, 4))
    facts = measure_model(model, batch, time_sizes=(2, 8))
    links = given_links(bandwidth=100e9, latency=1e-6, host_bandwidth=1e9)
    plan = ParallelPlan("pipeline", 1, 1, 4, activation_checkpointing=True)
    by_forward = step_time(facts, links, plan, samples=8)  # (not measured: the forward once more)
    assert by_forward.recompute > 0
    # Checkpointing adds half a forward to the forward (its hooks) and two to the backward.
    facts.times.measured["recompute"] = recompute_timing.RecomputeTimes(Line(1e-3), Line(5e-4), Line(2e-3))
    measured = step_time(facts, links, plan, samples=8)
    assert measured.recompute == pytest.approx(2.5 * by_forward.recompute)
    assert measured.seconds > by_forward.seconds
