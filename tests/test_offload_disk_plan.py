"""The disk tier in the planner (techniques/offload/disk_plan.py, disk_rate.py): its streaming charged at
the disk's bandwidth, its host buffer as the tier sizes it, the disk chosen only where the host cannot
hold the state, its budget, the bandwidth measured once in the directory; and plan="auto"'s arguments
for it."""

import time
from dataclasses import replace

import pytest
import torch
from tiny_models import SequentialRegressor

from lightning_parallel import PipelineStrategy
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import Link, given_links
from lightning_parallel.planner.ranking import Budget, fastest_fit, plan_search
from lightning_parallel.planner.search import Search
from lightning_parallel.planner.time_model import step_time
from lightning_parallel.strategies.pipeline import autoplan
from lightning_parallel.techniques.offload.disk_optimizer import DiskTier, disk_step
from lightning_parallel.techniques.offload.disk_plan import file_bytes
from lightning_parallel.techniques.offload.disk_rate import disk_bandwidth
from lightning_parallel.techniques.offload.disk_stream import SLOTS

GiB = 2**30


@pytest.fixture(scope="module")
def timed():
    torch.manual_seed(0)
    model = SequentialRegressor(d_in=16, hidden=64, depth=6, adam=True)
    return measure_model(model, (torch.randn(16, 16), torch.randn(16, 4)), time_sizes=(2, 8))


def test_the_files_are_read_and_written_once_a_step_at_the_disk_bandwidth(timed):
    """The disk tier's step is host offload's plus what its files' read and write (2 x the state at the
    disk's rate) outlast the host step by, plus one chunk's read and write; no disk in the links: host
    offload's time, as before; ZeRO-1 streams its half."""
    buffer = 2**16
    host = ParallelPlan("pipeline", 2, 1, 1, offload="optimizer")
    disk = ParallelPlan("pipeline", 2, 1, 1, offload="optimizer", offload_to="disk", offload_dir="/nvme",
                        offload_buffer=buffer)  # fmt: skip
    trainable = [t for t in timed.tensors.values() if t.grad]
    state = file_bytes(trainable)
    assert state == 8 * sum(t.numel for t in trainable) + 4 * len(trainable)  # (AdamW: 2 moments, a step)
    base = given_links(bandwidth=10e9, latency=1e-5, host_bandwidth=5e9)
    on_host = step_time(timed, base, host, samples=8)
    assert step_time(timed, base, disk, samples=8).offload == pytest.approx(on_host.offload)
    for rate in (1e6, 1e9):
        links = replace(base, disk=Link(0.0, rate))
        charged = step_time(timed, links, disk, samples=8).offload - on_host.offload
        host_step = on_host.optimizer
        chunk = min(state, buffer / (SLOTS + 1))
        assert charged == pytest.approx(max(0.0, 2 * state / rate - host_step) + 2 * chunk / rate, rel=1e-6)
    slow = replace(base, disk=Link(0.0, 1e6))
    assert step_time(timed, slow, disk, samples=8).offload - on_host.offload > 2 * state / 1e6 * 0.99
    zero = ParallelPlan("pipeline", 2, 1, 1, data_parallel="zero1", offload="optimizer", offload_to="disk",
                        offload_dir="/nvme", offload_buffer=buffer)  # fmt: skip
    zero_host = step_time(timed, slow, ParallelPlan("pipeline", 2, 1, 1, data_parallel="zero1",
                                                    offload="optimizer"), samples=8)  # fmt: skip
    half = step_time(timed, slow, zero, samples=8).offload - zero_host.offload
    assert half == pytest.approx(
        max(0.0, state / 1e6 - zero_host.optimizer) + 2 * min(state / 2, buffer / (SLOTS + 1)) / 1e6, rel=0.01
    )


@pytest.fixture(scope="module")
def large():
    """537 M parameters on the meta device (sized, not timed): AdamW's state is 4 GiB per replica."""
    with torch.device("meta"):
        model = SequentialRegressor(d_in=4096, hidden=4096, d_out=4096, depth=33, adam=True)
    return {1: measure_model(model, (torch.randn(16, 4096), torch.randn(16, 4096)))}


def test_the_disk_is_chosen_only_where_the_host_cannot_hold_the_state(large):
    """With a directory the search offers each optimizer offload on the host and on the disk; a loose host
    budget keeps the state on the host (the disk rows "not needed"), a tight one puts it on the disk
    (the host holding only the buffers), and a disk too small for the files fits nothing on disk."""
    search = Search(devices=2, global_batch_size=16, offload_dir="/nvme", offload_parameters=False)
    candidates = plan_search(large, search)
    on_disk = [c for c in candidates if c.plan.offload_to == "disk"]
    assert on_disk and all(c.host_twin is not None and c.disk_per_node > 0 for c in on_disk)
    assert not [c for c in plan_search(large, Search(devices=2, global_batch_size=16)) if c.plan.offload_to
                == "disk"], "no directory: no disk tier"  # fmt: skip
    loose = Budget(10 * GiB, host=256 * GiB, ranks_per_node=2)
    chosen = fastest_fit(candidates, loose)
    assert chosen is not None and chosen.plan.offload_to == "host", chosen.plan.label()
    assert all(loose.why_not(c) in ("not needed", "device") for c in on_disk)
    tight = Budget(10 * GiB, host=6 * GiB, ranks_per_node=2)
    chosen = fastest_fit(candidates, tight)
    assert chosen is not None and chosen.plan.offload_to == "disk", chosen.plan.label()
    assert chosen.plan.offload_dir == "/nvme" and chosen.host_per_node <= tight.usable_host
    assert chosen.host_twin > tight.usable_host  # (the same plan with the state on the host: over)
    assert "offload_to='disk', offload_dir='/nvme'" in chosen.plan.code()
    small_disk = Budget(10 * GiB, host=6 * GiB, ranks_per_node=2, disk=GiB)
    assert all(small_disk.why_not(c) in ("disk", "device") for c in on_disk)
    fallback = fastest_fit(candidates, small_disk)
    assert fallback is None or fallback.plan.offload_to == "host"
    assert "disk 1.00 GiB per node" in small_disk.describe()
    with pytest.raises(ValueError, match="disk=0"):
        Budget(GiB, disk=0)


def test_the_disk_bandwidth_is_measured_once_in_the_directory_quickly(tmp_path):
    start = time.perf_counter()
    rate = disk_bandwidth(str(tmp_path))
    assert 1e6 < rate < 1e12 and time.perf_counter() - start < 2.0
    assert list(tmp_path.iterdir()) == [], "the probe file is removed"
    with pytest.raises(ValueError, match=r"offload_dir '.*missing' does not exist: create it"):
        disk_bandwidth(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="must be positive"):
        disk_bandwidth(str(tmp_path), nbytes=0)
    links = replace(given_links(bandwidth=1e9), disk=Link(0, 2e9))
    assert "disk 0 us + 2.00 GB/s each way" in links.describe()


def test_plan_auto_takes_a_disk_budget_with_its_directory(tmp_path):
    strategy = PipelineStrategy(plan="auto", memory="1GiB", offload_dir=str(tmp_path), disk_memory="2TB")
    assert strategy._auto.offload_dir == str(tmp_path) and strategy._auto.disk_memory == 2 * 10**12
    assert strategy.parallel_plan.offload_dir is None  # (searched with, not given: the choice carries it)
    assert PipelineStrategy(plan="auto", memory="1GiB", offload_dir=str(tmp_path))._auto.disk_memory is None
    with pytest.raises(ValueError, match=r"disk_memory='1TB' is the room under offload_dir, which is not"):
        PipelineStrategy(plan="auto", memory="1GiB", disk_memory="1TB")
    with pytest.raises(ValueError, match=r"disk_memory: only for plan='auto': pass plan='auto' too"):
        PipelineStrategy(pipeline_size=1, disk_memory="1TB")
    with pytest.raises(ValueError, match=r"offload_dir=.* sets the disk tier, but offload_to='host'"):
        PipelineStrategy(pipeline_size=1, offload_dir=str(tmp_path))  # (by hand: still refused)
    assert autoplan._disk_room(str(tmp_path)) > 0 and autoplan._disk_room(None) is None
    for given in ({}, {"offload": "optimizer"}):  # (one message, whatever else was given beside it)
        with pytest.raises(
            ValueError, match=r"plan='auto' chooses where .* drop offload_to and keep offload_dir"
        ):
            PipelineStrategy(
                plan="auto", memory="1GiB", offload_to="disk", offload_dir=str(tmp_path), **given
            )


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_host_column_holds_the_buffer_the_tier_allocates_not_its_bound(tmp_path, precision):
    """A small model under the default 1 GiB bound: the planner's host bytes for its disk tier are the
    slots and work area the real tier allocates for the same parameters (its buffers' peak after a step),
    not the bound; under a bound of half that, what the tier allocates then (fp32 and bf16 parameters,
    the latter with fp32 masters in the files and a rounding in the work area)."""
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    torch.manual_seed(0)
    model = SequentialRegressor(d_in=16, hidden=64, depth=3, adam=True).to(dtype)
    facts = measure_model(
        model, (torch.randn(16, 16, dtype=dtype), torch.randn(16, 4, dtype=dtype)), precision
    )

    def allocated(bound: int) -> int:
        tier = disk_step(torch.optim.AdamW(model.parameters(), lr=1e-3), DiskTier(str(tmp_path), bound))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        tier.step()
        tier.close()
        return tier.buffers.peak

    whole = allocated(GiB)
    for bound, held in ((GiB, whole), (whole // 2, allocated(whole // 2))):
        plan = ParallelPlan("pipeline", 1, 1, 1, offload="optimizer", offload_to="disk",
                            offload_dir=str(tmp_path), offload_buffer=bound)  # fmt: skip
        assert predict(facts, plan).host == held, (precision, bound, held)
    assert whole < GiB // 1000 and held <= whole // 2
