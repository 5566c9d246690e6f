"""distributed/tensors.py: coalesced all-reduce and broadcast of many tensors, and subgroups (gloo)."""

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo

from lightning_parallel.distributed.tensors import all_reduce_coalesced, broadcast_coalesced, new_subgroups


def _mixed(value):
    """Tensors of three dtypes and several shapes, every element ``value`` (cast to the dtype)."""
    return [
        torch.full((2, 3), value, dtype=torch.float32),
        torch.full((4,), value, dtype=torch.float64),
        torch.full((1,), value, dtype=torch.float32),
        torch.full((3,), value, dtype=torch.int64),
    ]


def test_one_process_leaves_the_tensors_as_they_are():
    tensors = [torch.tensor([1.0, -2.0]), torch.tensor([3], dtype=torch.int64)]
    all_reduce_coalesced(tensors, None, average=True)
    all_reduce_coalesced(tensors, None, op="max")
    broadcast_coalesced(tensors, 0, None)
    all_reduce_coalesced([], None)
    assert tensors[0].tolist() == [1.0, -2.0] and tensors[1].tolist() == [3]
    assert new_subgroups([[0]]) is None  # no process group: nothing to create


def _worker(rank: int, world: int, out_dir: str) -> None:
    out = {}
    summed, maxed = _mixed(rank + 1), _mixed(10 - rank)
    averaged = _mixed(rank + 1)[:3]  # gradients: floating point
    all_reduce_coalesced(summed, None)
    all_reduce_coalesced(averaged, None, average=True)
    all_reduce_coalesced(maxed, None, op="max")
    broadcasted = _mixed(rank)
    broadcast_coalesced(broadcasted, 2, None)
    out.update(summed=summed, averaged=averaged, maxed=maxed, broadcasted=broadcasted)

    # Ranks 0 and 2 form a group; rank 1 is in none but still calls new_subgroups (a collective).
    group = new_subgroups([[0, 2]])
    out["in_group"] = group is not None
    if group is not None:
        pair = _mixed(rank + 1)[:3]  # average: floating point only
        all_reduce_coalesced(pair, group, average=True)
        from_two = _mixed(rank)
        broadcast_coalesced(from_two, 2, group)  # src is a global rank
        out.update(pair=pair, from_two=from_two, pair_size=dist.get_world_size(group))
    torch.save(out, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_gloo_ranks_reduce_and_broadcast_every_dtype_in_place(tmp_path):
    results = spawn_gloo(_worker, 3, tmp_path)
    for rank, r in enumerate(results):
        for name, expected in (("summed", 6), ("maxed", 10), ("broadcasted", 2)):
            for got, want in zip(r[name], _mixed(expected)):
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, name, got)
        for got, want in zip(r["averaged"], _mixed(2)[:3]):
            torch.testing.assert_close(got, want)
    assert [r["in_group"] for r in results] == [True, False, True]
    for r in (results[0], results[2]):
        assert r["pair_size"] == 2
        for got, want in zip(r["pair"], _mixed(2)[:3]):  # (1 + 3) / 2, over the pair only
            assert got.dtype == want.dtype and torch.equal(got, want)
        for got, want in zip(r["from_two"], _mixed(2)):
            assert torch.equal(got, want)
