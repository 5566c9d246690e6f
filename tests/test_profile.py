"""profile.py: measured forward+backward time per layer or block (for partition="time")."""

import itertools

import torch
from test_partition import _best_max_cost
from tiny_models import TinyGPT
from torch import nn

from lightning_parallel.pipeline.partition import partition_balanced, stage_costs
from lightning_parallel.sources.profile import block_times, layer_times


def uneven_layers() -> nn.Sequential:
    """Widths 8, 1024, 1024, 8, 8, 8: the 1024x1024 layer costs far more than any other."""
    widths = [8, 1024, 1024, 8, 8, 8]
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)), nn.Linear(8, 4))


def test_time_partition_balances_measured_costs_within_one_layer_of_the_best():
    layers = uneven_layers()
    costs = layer_times(layers, (torch.randn(512, 8),), torch.device("cpu"), repeats=5)
    assert costs[1] > 5 * max(costs[3:])  # the wide layer is measured as such
    counts = partition_balanced(costs, 2)
    assert max(stage_costs(costs, counts)) - _best_max_cost(costs, 2) < max(costs)
    assert all(p.grad is None for p in layers.parameters())  # timing leaves no gradients behind


def test_block_times_measure_blocks_inside_whole_model_runs():
    model = TinyGPT(dim=16, depth=3)
    # Block 1 does far more work than the others: ~40x their time alone (a hidden width of 1024 made it
    # 2-4x, which a loaded machine's noise could hide: the suite failed once at 1.85x).
    wide = nn.Sequential(nn.Linear(16, 8192), nn.GELU(), nn.Linear(8192, 16))
    model.h[1].mlp = wide
    costs = block_times(model, (torch.randint(0, 13, (64, 8)),), ["h.0", "h.1", "h.2"], repeats=3)
    assert len(costs) == 3 and min(costs) > 0
    assert costs[1] > 2 * max(costs[0], costs[2])
    assert all(p.grad is None for p in model.parameters())
