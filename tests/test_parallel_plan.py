"""The one plan value: made and checked once, what the strategy runs and what the planner returns.

Covers plan/parallel_plan.py, plan/checks.py, layout/choices.py, layout/ranks.py and
strategies/pipeline/options.py (the strategy's options mapped onto the plan). Pure: no process group.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_parallel import ParallelPlan, PipelineStrategy
from lightning_parallel.layout.choices import DATA_PARALLEL, SCHEDULES, placement, schedule_class
from lightning_parallel.planner.ranking import candidate_plans
from lightning_parallel.strategies.pipeline.options import PLAN_OPTIONS


def test_a_plan_normalises_its_settings_once():
    plan = ParallelPlan(
        schedule="Interleaved_1F1B", stages_per_rank=2, partition=[2, 1, 1, 2], compile=True,
        activation_checkpointing=["h.1"],
    )  # fmt: skip
    assert plan.schedule == "interleaved_1f1b" and plan.partition == (2, 1, 1, 2)
    assert plan.compile == {"dynamic": True} and plan.compiled
    assert plan.activation_checkpointing == ("h.1",)
    assert ParallelPlan(schedule="zbv").stages_per_rank == 2  # implied by the V schedules
    assert ParallelPlan("ddp", 4).num_microbatches == 1  # a whole-model plan has no pipeline settings


def test_sizes_follow_the_devices():
    plan = ParallelPlan(pipeline_size=2, data_parallel="fsdp", data_parallel_shard_size=2)
    with pytest.raises(ValueError, match="no device count yet"):
        _ = plan.data_parallel_size
    eight = plan.for_devices(8, "bf16-mixed")
    assert (eight.data_parallel_size, eight.shard_size, eight.num_stages) == (4, 2, 2)
    assert eight.layout().mesh_shape == (2, 2, 2, 1) and eight.precision == "bf16-mixed"
    assert ParallelPlan(tensor_parallel_size=2).for_devices(4).pipeline_size == 2  # all the rest pipelines
    assert ParallelPlan(pipeline_size=2, tensor_parallel_size=2).layout(8).mesh_shape == (2, 2, 1, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"schedule": "zigzag"}, ValueError, "unknown schedule 'zigzag': choose one of gpipe"),
        ({"schedule": "interleaved_1f1b"}, ValueError, "stages_per_rank>=2 with the interleaved"),
        ({"schedule": "zbv", "stages_per_rank": 3}, ValueError, "runs exactly 2 stages per rank in a V"),
        ({"num_microbatches": 0}, ValueError, "num_microbatches must be a positive int, got 0"),
        ({"partition": "flops"}, ValueError, "unknown partition 'flops'"),
        ({"data_parallel": "zero3"}, ValueError, "unknown data_parallel='zero3'"),
        ({"data_parallel_shard_size": 2}, ValueError, "shards stages with FSDP2, but data_parallel="),
        ({"tensor_parallel_size": 2, "data_parallel": "zero1"}, ValueError, "ZeroRedundancyOptimizer"),
        ({"tensor_parallel_plan": {"a": ColwiseParallel()}}, ValueError, "but tensor_parallel_size=1"),
        ({"compile": True, "schedule": "zbv"}, ValueError, "compile with schedule='zbv' is not supported"),
        ({"compile": {"fulgraph": True}}, TypeError, "did you mean 'fullgraph'"),
        ({"activation_checkpointing": "h.1"}, TypeError, "activation_checkpointing must be True/False"),
        (
            {"split_points": ["h.1"], "partition": "parameters"},
            ValueError,
            "drop partition= and module_name=",
        ),
        ({"precision": "fp8"}, ValueError, "unknown precision 'fp8'"),
        ({"devices": 4, "pipeline_size": 3}, ValueError, r"pipeline_size \(3\) does not divide devices"),
        ({"strategy": "single_device", "devices": 2}, ValueError, "runs on one device, got devices=2"),
        ({"strategy": "ddp", "data_parallel": "fsdp"}, ValueError, "shards the stages of a pipeline"),
        ({"parallelize_fn": 3}, TypeError, "parallelize_fn must be a callable"),
        ({"offload": "optimiser"}, TypeError, "did you mean 'optimizer'"),
        ({"offload": "parameters"}, ValueError, "offload='parameters' is FSDP2's offload"),
        ({"strategy": "ddp", "offload": "optimizer"}, ValueError, "offload runs under PipelineStrategy"),
        ({"offload_pin_memory": "yes"}, TypeError, "offload_pin_memory must be True, False or None"),
    ],
)
def test_each_bad_setting_is_refused_with_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        ParallelPlan(**kwargs)


def test_the_strategy_maps_every_option_onto_its_plan_in_one_place():
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=8, shard_optimizer_state=True, compile=True)
    plan = strategy.parallel_plan
    assert plan == ParallelPlan(pipeline_size=2, num_microbatches=8, data_parallel="zero1", compile=True)
    assert not hasattr(strategy, "num_microbatches")  # one home for each setting: the plan
    # Every plan option is a keyword of the strategy, documented once (in the plan) and shown in its help.
    for name in PLAN_OPTIONS:
        assert f"\n        {name}:" in PipelineStrategy.__doc__, name
    with pytest.raises(ValueError, match="shard_optimizer_state=True is data_parallel='zero1'"):
        PipelineStrategy(shard_optimizer_state=True, data_parallel="fsdp")


def test_a_planner_row_is_a_plan_the_strategy_runs():
    rows = candidate_plans(devices=8, num_blocks=8, global_batch=64, layout="sequential")
    pipelines = [r for r in rows if r.strategy == "pipeline"]
    assert len(pipelines) > 20
    for row in pipelines:
        strategy = PipelineStrategy.from_plan(row)
        # The strategy runs the same plan (the Trainer supplies devices, precision and accumulation).
        ran = strategy.parallel_plan.for_devices(8, row.precision)
        assert ran == row, (row.label(), ran.label())
        assert ran.label() == row.label()
        assert (
            eval(row.code(), {"PipelineStrategy": PipelineStrategy}).parallel_plan == strategy.parallel_plan
        )
    ddp = next(r for r in rows if r.strategy == "ddp")
    assert ddp.code() == "Trainer(strategy='ddp', devices=8)"
    with pytest.raises(ValueError, match="is not a PipelineStrategy: use Trainer"):
        PipelineStrategy.from_plan(ddp)


def test_offload_names_what_lives_on_the_host():
    assert ParallelPlan(offload="optimizer").offload == ("optimizer",)
    fsdp = ParallelPlan(
        devices=4, pipeline_size=2, data_parallel="fsdp", offload=["parameters", "activations"]
    )
    assert fsdp.offload == ("activations", "optimizer", "parameters")  # FSDP2's offload takes the state
    assert fsdp.label() == "pp 2x2 1f1b m=4 +fsdp +offload act,param"
    assert ParallelPlan(offload=None).offload == () == ParallelPlan().offload


def test_each_choice_list_is_defined_once():
    assert set(DATA_PARALLEL) == {"replicate", "zero1", "fsdp"}
    assert all(schedule_class(s) for s in SCHEDULES)
    assert placement("dualpipev") == "v" and placement("1f1b") == "loop"
