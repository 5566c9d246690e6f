"""partition.py: uniform, balanced and explicit splits of layer costs into stages (pure logic)."""

import itertools

import pytest
import torch

from lightning_parallel.pipeline.partition import (
    check_explicit,
    partition_balanced,
    partition_uniform,
    stage_costs,
)


def _best_max_cost(costs, stages):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_uniform_gives_the_remainder_to_early_stages():
    assert partition_uniform(10, 4) == [3, 3, 2, 2]
    assert partition_uniform(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"num_stages \(5\) is larger than the number of layers .* \(4\)"):
        partition_uniform(4, 5)


@pytest.mark.parametrize("seed", range(20))
def test_balanced_partition_is_the_best_contiguous_split(seed):
    g = torch.Generator().manual_seed(seed)
    n, stages = int(torch.randint(2, 10, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    stages = min(stages, n)
    costs = (torch.rand(n, generator=g) * 10).tolist()
    counts = partition_balanced(costs, stages)
    assert sum(counts) == n and min(counts) >= 1 and len(counts) == stages
    assert max(stage_costs(costs, counts)) == pytest.approx(_best_max_cost(costs, stages))


def test_explicit_partition_is_validated():
    assert check_explicit([1, 3], 4, 2) == [1, 3]
    with pytest.raises(ValueError, match=r"places 3 layers but the Sequential has 4"):
        check_explicit([1, 2], 4, 2)
    with pytest.raises(ValueError, match=r"lists 3 stages \(\[1, 1, 2\]\) but the pipeline has 2"):
        check_explicit([1, 1, 2], 4, 2)
    with pytest.raises(ValueError, match="at least one layer"):
        check_explicit([0, 4], 4, 2)
    with pytest.raises(ValueError, match=r"places 5 blocks but `h` has 4: the counts must add up to 4"):
        check_explicit([2, 3], 4, 2, "blocks", "`h`")
