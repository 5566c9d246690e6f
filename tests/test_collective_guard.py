"""distributed/collective_guard.py: collectives limited to some ranks while a block runs (one gloo rank)."""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.distributed.collective_guard import collectives_limited_to, group_ranks


def test_a_collective_beyond_the_ranks_is_refused_by_name_and_the_functions_come_back(one_rank):
    original = dist.all_reduce
    own = dist.new_group([0])
    with collectives_limited_to(frozenset(), lambda name: f"refused {name}"):
        assert dist.all_reduce(torch.ones(1)) == "refused all_reduce"  # the world reaches beyond
        assert dist.barrier(group=dist.group.WORLD) == "refused barrier"
        assert dist.distributed_c10d.broadcast(torch.ones(1), 0) == "refused broadcast"
    assert dist.all_reduce is original and dist.all_reduce(torch.ones(1)) is None
    with collectives_limited_to(frozenset({0}), lambda name: pytest.fail(f"{name} refused")):
        t = torch.ones(1)
        dist.all_reduce(t, group=own)  # a group of the block's ranks goes through
        dist.all_gather_object([None], "x")
    assert group_ranks(None) == group_ranks(own) == frozenset({0})
