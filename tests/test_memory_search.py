"""The planner's search (planner/search.py): which plans it tries. Pure, milliseconds.

The plan set is pinned against the search's rules written out as plain nested loops (pipeline sizes x
schedules x micro-batches x recomputation x data-parallel modes x offloads), as the search enumerated
them before it became a fold over the techniques' variants, and by its size for each configuration.
"""

from __future__ import annotations

import pytest

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.search import Search


def _rules(search: Search, num_blocks: int, tp: int, fsdp: bool) -> list[ParallelPlan]:
    """Every plan the search's rules allow, one nested loop per searched setting."""
    ranks = search.devices // tp
    every = [p for p in range(1, ranks + 1) if ranks % p == 0 and p <= num_blocks]
    sizes = [p for p in (search.pipeline_sizes or every) if ranks % p == 0]
    out = []
    for p in sizes:
        base = ParallelPlan(
            "pipeline", search.devices, p, tensor_parallel_size=tp, precision=search.precision
        )
        found = search.batches(base)
        if found is None:
            continue
        batch = found[0]
        schedules = [("1f1b", 1)] if p == 1 else [(s, 1) for s in search.schedules if s in ("gpipe", "1f1b")]
        if p > 1 and "interleaved_1f1b" in search.schedules and 2 * p <= num_blocks:
            schedules.append(("interleaved_1f1b", 2))
        micro = [m for m in ((1, 2, 4) if p == 1 else (p, 2 * p, 4 * p)) if m <= batch and batch % m == 0]
        modes = ["replicate"]
        if base.data_parallel_size > 1:
            modes += (["zero1"] if tp == 1 else []) + (["fsdp"] if fsdp else [])
        for schedule, v in schedules:
            for m in micro:
                for ac in (False, True):
                    for mode in modes:
                        offloads: list[tuple[str, ...]] = [()]
                        if search.offload and tp == 1:
                            offloads.append(("optimizer",))  # (FSDP2's too: its shards stepped on the host)
                            if mode == "fsdp" and search.offload_parameters:
                                offloads.append(("parameters",))
                            if not ac:
                                offloads.append(("activations",))
                        for offload in offloads:
                            out.append(ParallelPlan(
                                "pipeline", search.devices, p, m, schedule, v, activation_checkpointing=ac,
                                data_parallel=mode, tensor_parallel_size=tp, offload=offload,
                                precision=search.precision,
                            ))  # fmt: skip
    return out


# (search, num_blocks, tensor-parallel size, FSDP2 possible) -> how many plans
CASES = [
    (Search(devices=4, global_batch_size=32), 8, 1, False, 165),
    (Search(devices=4, global_batch_size=32), 8, 1, True, 249),
    (Search(devices=4, global_batch_size=32, offload=False), 8, 1, True, 90),
    (Search(devices=4, global_batch_size=32, offload_parameters=False), 3, 1, True, 135),
    (Search(devices=8, global_batch_size=64, batch_size=4), 8, 2, True, 42),
    (Search(devices=8, global_batch_size=64, pipeline_sizes=(2, 4), schedules=("gpipe",)), 8, 2, False, 12),
    (Search(devices=1, batch_size=8, precision="bf16-mixed"), 4, 1, True, 15),
]


@pytest.mark.parametrize(("search", "num_blocks", "tp", "fsdp", "count"), CASES)
def test_the_search_tries_every_plan_its_rules_allow_once(search, num_blocks, tp, fsdp, count):
    plans = search.plans(num_blocks, tp, "sequential" if fsdp else "blocks")
    assert len(plans) == len(set(plans)) == count
    assert set(plans) == set(_rules(search, num_blocks, tp, fsdp))
