"""Offloaded activations timed in place (``techniques/offload/timing.py``): what the hooks add to a block's
forward and backward, per byte they packed, and what a stage is charged from it."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import SequentialRegressor
from torch import nn

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import given_links
from lightning_parallel.planner.stage_costs import stage_costs
from lightning_parallel.planner.time_model import step_time
from lightning_parallel.techniques.ledgers import Line, TimeBench, UnitSample
from lightning_parallel.techniques.offload import timing
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.technique import TECHNIQUE


def test_the_hooks_own_cost_is_measured_per_tensor_and_the_bytes_they_packed(monkeypatch):
    """A fake clock that only the hooks move (1 s a tensor packed, 0.25 s one unpacked): the block's own
    compute costs nothing, so the measured extra is the hooks' and nothing else."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])  # (the TimeBench's span reads it)
    pack, unpack = ActivationOffload._pack, ActivationOffload._unpack
    counts = {"pack": 0, "unpack": 0}

    def slow_pack(self, tensor):
        clock[0] += 1.0
        counts["pack"] += 1
        return pack(self, tensor)

    def slow_unpack(self, packed):
        clock[0] += 0.25
        counts["unpack"] += 1
        return unpack(self, packed)

    monkeypatch.setattr(ActivationOffload, "_pack", slow_pack)
    monkeypatch.setattr(ActivationOffload, "_unpack", slow_unpack)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    inputs = {n: ((torch.randn(n, 4, requires_grad=True),), {}) for n in (2, 8)}
    bench = TimeBench(
        ranks=1, device=torch.device("cpu"), samples=[UnitSample("b", block, inputs)], repeats=1
    )
    times = TECHNIQUE.measure(bench)
    assert isinstance(times, timing.ActivationTimes)

    hooks = ActivationOffload()  # (what one forward and backward of the block packs and unpacks)
    counts.update(pack=0, unpack=0)
    with hooks:
        out = block(inputs[8][0][0])
    out.sum().backward()
    assert counts["pack"] > 0 and counts["unpack"] > 0
    for n in (2, 8):
        assert times.forward.at(n) == pytest.approx(counts["pack"])
        assert times.backward.at(n) == pytest.approx(0.25 * counts["unpack"])
    assert times.packed.at(8) == hooks.packed_bytes > times.packed.at(2) > 0
    # A block that saves nothing for backward: nothing to charge, not measured.
    frozen = UnitSample("f", nn.Identity(), {2: ((torch.randn(2, 4),), {})})
    assert TECHNIQUE.measure(TimeBench(ranks=1, device=torch.device("cpu"), samples=[frozen])) is None


def test_a_stage_pays_the_blocks_seconds_per_byte_at_its_own_bytes():
    torch.manual_seed(0)
    model, batch = SequentialRegressor(d_in=16, hidden=64, depth=4), (torch.randn(8, 16), torch.randn(8, 4))
    facts = measure_model(model, batch, time_sizes=(2, 8))
    links = given_links(bandwidth=100e9, latency=1e-6, host_bandwidth=1e9)
    plan = ParallelPlan("pipeline", 1, 1, 4, offload="activations")
    by_links = step_time(facts, links, plan, samples=8)
    # 1 ms forward and 0.5 ms backward per 1000 bytes packed at any micro-batch size.
    facts.times.measured["offload"] = timing.ActivationTimes(Line(1000.0), Line(1e-3), Line(5e-4))
    try:
        measured = step_time(facts, links, plan, samples=8)
    finally:
        del facts.times.measured["offload"]
    (stage,) = stage_costs(facts, plan, samples=8)
    assert stage.per_microbatch > 0
    assert measured.offload == pytest.approx(4 * stage.per_microbatch / 1000 * 1.5e-3)
    assert by_links.offload == pytest.approx(4 * 2 * links.copy(stage.per_microbatch))
    assert timing.ActivationTimes(Line(0.0), Line(1.0), Line(1.0)).seconds(100, 2) == (0.0, 0.0)
