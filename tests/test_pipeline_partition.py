"""Partition, stage plan, micro-batch choice, proxy and log combination: pure logic, no processes."""

import itertools

import pytest
import torch
from mp_harness import quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data
from torch import nn

from lightning_parallel import PipelineStrategy
from lightning_parallel.pipeline.partition import (
    check_explicit,
    partition_balanced,
    partition_uniform,
    stage_costs,
)
from lightning_parallel.pipeline.plan import make_plan
from lightning_parallel.pipeline.profile import layer_times
from lightning_parallel.pipeline.proxy import PipelinedSequential
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.step_logs import LogRecorder


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


def test_stage_table_names_stages_ranks_layers_and_parameters():
    names, types = ["0", "1", "2", "3"], ["Embedding", "Block", "Block", "Linear"]
    plan = make_plan(names, types, [5, 7, 7, 2], [1, 3], pp_size=2, dp_size=2)
    table = plan.format_table()
    assert "0      0,1    0  (Embedding)" in table
    assert "1      2,3    1-3  (Blockx2, Linear)  16" in table
    assert "2 stages on 2 pipeline ranks x 2 data-parallel replicas; 21 parameters" in table
    assert plan.coordinates(3) == (1, 1) and plan.global_rank(1, 0) == 2


def test_interleaved_stages_loop_over_pipeline_ranks():
    plan = make_plan([str(i) for i in range(8)], ["L"] * 8, [1] * 8, [2] * 4, pp_size=2, dp_size=1)
    assert [s.index for s in plan.local_stages(0)] == [0, 2]
    assert [s.index for s in plan.local_stages(1)] == [1, 3]
    assert plan.stages_per_rank == 2


def test_microbatches_use_the_largest_divisor_of_the_batch():
    runner = PipelineRunner([nn.Identity()], [0], 1, torch.device("cpu"), None, "gpipe", 4)
    assert [runner.microbatches_for(n) for n in (16, 12, 10, 7, 6, 3, 1)] == [4, 4, 2, 1, 3, 3, 1]


def test_proxy_captures_the_input_and_replays_the_output_once():
    proxy = PipelinedSequential({"3": nn.Linear(2, 2)}, name="layers")
    assert list(proxy.state_dict()) == ["3.weight", "3.bias"]
    x = torch.ones(4, 2)
    assert proxy.capture(lambda inp: proxy(inp) + 1, x)[0] is x
    with proxy.replaying("out"):
        assert proxy(x) == "out"
        with pytest.raises(RuntimeError, match="called twice in one step"):
            proxy(x)
    with pytest.raises(RuntimeError, match="holds only this rank's pipeline stage"):
        proxy(x)
    with pytest.raises(RuntimeError, match="returned without calling the pipelined Sequential"):
        proxy.capture(lambda inp: inp, x)


def test_logged_values_combine_over_micro_batches_like_one_call_over_the_batch():
    module = nn.Module()
    recorder = LogRecorder()
    for value, samples in ((1.0, 3), (4.0, 1)):
        with recorder.recording(module, samples):
            module.log("loss", torch.tensor(value), prog_bar=True)
            module.log("most", value, reduce_fx="max")
            module.log("tokens", value, reduce_fx="sum", batch_size=2)
    loss, most, tokens = recorder.entries()
    assert loss.combined() == pytest.approx((1 * 3 + 4 * 1) / 4) and loss.replay_kwargs()["batch_size"] == 4
    assert most.combined() == 4.0 and tokens.combined() == 5.0 and tokens.replay_kwargs()["batch_size"] == 4
    assert not hasattr(module, "log")  # the recorder's stand-in is gone
    with recorder.recording(module, 1), pytest.raises(TypeError, match="log a tensor or a number"):
        module.log("metric", object())


class UnevenLayers(SequentialRegressor):
    """Layer widths 8, 1024, 1024, 8, 8, 8: the 1024x1024 layer costs far more than any other."""

    def __init__(self):
        super().__init__()
        widths = [8, 1024, 1024, 8, 8, 8]
        layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
        self.layers = nn.Sequential(*layers, nn.Linear(8, 4))


def test_time_partition_balances_measured_costs_within_one_layer_of_the_best():
    model = UnevenLayers()
    x = torch.randn(512, 8)
    costs = layer_times(model.layers, (x,), torch.device("cpu"), repeats=5)
    assert costs[1] > 5 * max(costs[3:])  # the wide layer is measured as such
    counts = partition_balanced(costs, 2)
    assert max(stage_costs(costs, counts)) - _best_max_cost(costs, 2) < max(costs)


def test_time_partition_end_to_end_prints_a_plan_from_the_first_batch():
    strategy = PipelineStrategy(
        num_stages=1, stages_per_rank=2, schedule="interleaved_1f1b", partition="time"
    )
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=1)
    # Lightning 2.6.6 keeps the loader where _first_training_batch reads it; fail loudly if not.
    trainer.fit(UnevenLayers(), loader(regression_data(), 8))
    assert strategy.plan is not None and strategy.plan.cost_unit == "ms fwd+bwd"
    assert "cost (ms fwd+bwd)" in strategy.plan.format_table()
    assert hasattr(trainer.fit_loop, "_data_source")
