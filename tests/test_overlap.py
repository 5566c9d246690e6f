"""Overlapped gradient reduction (techniques/overlap.py): the buckets, the plan's options, and the bucketed
all-reduce started during the last backward against the one coalesced all-reduce after it (bitwise).

The Trainer-level on/off comparison (2 stages x 2 replicas, accumulation, clipping) runs inside the
spawned job of test_pipeline_idioms.py; the configuration matrix covers the rest.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo

from lightning_parallel import ParallelPlan, PipelineStrategy
from lightning_parallel.distributed.tensors import all_reduce_coalesced
from lightning_parallel.techniques.job import StepPhase
from lightning_parallel.techniques.overlap import BucketedAverage, bucket_layout


def test_buckets_follow_the_order_close_at_the_cap_and_never_mix_dtypes():
    ps = [
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(2, dtype=torch.bfloat16),
        torch.zeros(8),
        torch.zeros(1),
    ]
    assert [len(b) for b in bucket_layout(ps, cap_bytes=1 << 20)] == [2, 1, 2]
    assert [len(b) for b in bucket_layout(ps, cap_bytes=16)] == [1, 1, 1, 1, 1]
    assert [[id(p) for p in b] for b in bucket_layout(ps, 1 << 20)] == [[id(ps[0]), id(ps[1])], [id(ps[2])], [
        id(ps[3]), id(ps[4])]]  # fmt: skip
    assert bucket_layout([], 1) == []


def test_the_options_are_checked_with_the_value_and_on_by_default():
    plan = ParallelPlan(pipeline_size=2)
    assert plan.overlap_gradient_reduction is True and plan.bucket_cap_mb == 25.0
    assert ParallelPlan(pipeline_size=2, bucket_cap_mb=4).bucket_cap_mb == 4.0
    off = PipelineStrategy(pipeline_size=2, overlap_gradient_reduction=False, bucket_cap_mb=50)
    assert (off.parallel_plan.overlap_gradient_reduction, off.parallel_plan.bucket_cap_mb) == (False, 50.0)
    assert "overlap_gradient_reduction=False" in off.parallel_plan.code()
    with pytest.raises(TypeError, match=r"overlap_gradient_reduction must be True .* got 'yes'"):
        ParallelPlan(overlap_gradient_reduction="yes")
    for bad in (0, -1.0, float("nan"), True, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
            ParallelPlan(bucket_cap_mb=bad)
    with pytest.raises(TypeError, match="overlap_gradient_reduction"):
        PipelineStrategy(overlap_gradient_reductions=False)  # misspelt: the closest name


class _Mixed(torch.nn.Module):
    """Three float32 layers and a bfloat16 one: several buckets, two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8)
        self.low = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.c = torch.nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(self.low(x.bfloat16()).float())


def _backward(model, batches):
    for x in batches:
        model(x).pow(2).mean().backward()


def _worker(rank: int, world: int, out_dir: str) -> None:
    torch.manual_seed(0)
    base = _Mixed()
    g = torch.Generator().manual_seed(rank + 1)
    window = [[torch.randn(4, 6, generator=g) for _ in range(2)] for _ in range(2)]  # 2 batches x 2 mbs
    record = {}
    for mode in ("coalesced", "overlap", "off", "late", "late_coalesced"):
        coalesced, late = mode.endswith("coalesced"), mode.startswith("late")
        model, phase = copy.deepcopy(base), StepPhase()
        params = list(reversed(list(model.parameters())))
        average = BucketedAverage(bucket_layout(params, 200), dist.group.WORLD, phase, overlap=mode != "off")
        started = []
        for last, batches in zip((False, True), window):
            phase.microbatches, phase.reduces = len(batches), last and not coalesced
            with average:
                _backward(model, batches)
                if late and last:
                    _backward(model, batches[:1])  # a gradient after its bucket started
            started.append(average.in_flight)
        if coalesced:
            all_reduce_coalesced([p.grad for p in model.parameters()], dist.group.WORLD, average=True)
        else:
            average(finished=())
            started.append(average.started)
        spans = [(name, end - start) for name, start, end in getattr(average, "spans", [])]
        record[mode] = ([p.grad.clone() for p in model.parameters()], started, len(average.buckets), spans)
    torch.save(record, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_buckets_started_in_the_last_backward_average_bitwise_as_one_all_reduce_after_it(tmp_path):
    results = spawn_gloo(_worker, 2, tmp_path)
    for r in results:
        reference, _, buckets, _ = r["coalesced"]
        assert buckets >= 3
        assert r["overlap"][1] == [
            0,
            buckets,
            buckets,
        ]  # nothing in the window's first batch, all in its last
        assert r["off"][1] == [0, 0, 0]
        # The timeline's spans: each bucket started in backward, from its start to its completion.
        assert [name for name, _ in r["overlap"][3]] == [f"all-reduce bucket {i}" for i in range(buckets)]
        assert all(ns > 0 for _, ns in r["overlap"][3]) and r["off"][3] == []
        for mode in ("overlap", "off"):
            assert all(torch.equal(a, b) for a, b in zip(r[mode][0], reference)), mode
        # A late gradient: its bucket reduced again at the wait, from the gradient then there.
        assert r["late"][1] == [0, buckets, buckets]
        assert all(torch.equal(a, b) for a, b in zip(r["late"][0], r["late_coalesced"][0]))
        assert not torch.equal(r["late"][0][0], reference[0])
    assert all(torch.equal(a, b) for a, b in zip(results[0]["overlap"][0], results[1]["overlap"][0]))
