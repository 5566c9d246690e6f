"""PipelineStrategy(data_parallel="fsdp"): FSDP2 inside pipeline stages, what only FSDP2 has.

FSDP2's view-output warning and its filter, the data-parallel options' refusals, what a traced forward
refuses, and a parallelize_fn given each stage and the mesh. Every multi-process configuration (FSDP2
and HSDP stages on both stage sources, with every schedule, recomputation, offload, tensor parallelism,
validation and resumes) is a case of the configuration matrix (tests/matrix.py, run by
tests/test_matrix.py), with FSDP2's own check there (tests/matrix_checks.py: one reduce-scatter per
optimizer step, every stage parameter a DTensor, the stage table's bytes, the view warning filtered).

Covers techniques/fsdp/technique.py's technique through the stage view (parallelize_fn, then FSDP2, on each
stage module: techniques/fsdp/sharding.py; the traced configurations' one FSDP root per stage:
techniques/fsdp/traced.py) through the matrix's cases; the planner's bytes (techniques/fsdp/memory.py) in
tests/test_memory_estimate.py, its measured times (techniques/fsdp/timing.py) in tests/test_planner_fold.py.
"""

import re
import warnings

import pytest
import torch
from mp_harness import quiet_trainer
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.pipeline.plan import make_plan
from lightning_parallel.planner.resolve import resolve
from lightning_parallel.techniques.fsdp import sharding
from lightning_parallel.techniques.fsdp.technique import refuse_shared_on_one_rank


class AdamRegressor(SequentialRegressor):
    def __init__(self):
        super().__init__(hidden=32, depth=5, adam=True)


def test_fsdp2_warns_of_a_view_output_as_the_filter_expects_and_the_filter_quiets_it(one_rank):
    """torch 2.13's FSDP2 warns at each forward whose output is a view (nn.Linear on a 3-D input gives
    one); sharding.VIEW_OUTPUT_WARNING matches that warning, and quiet_view_output_warning() filters it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    head = fully_shard(torch.nn.Linear(4, 3), mesh=init_device_mesh("cpu", (1,)))
    x = torch.randn(2, 5, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        head(x)
        sharding.quiet_view_output_warning()
        head(x)
    views = [str(w.message) for w in shown if re.match(sharding.VIEW_OUTPUT_WARNING, str(w.message))]
    assert len(views) == 1, [str(w.message) for w in shown]  # the first forward's only
    assert "FSDPLinear" in views[0]


def test_data_parallel_options_are_checked():
    with pytest.raises(ValueError, match=r"unknown data_parallel='zero3': use one of 'replicate', 'zero1'"):
        PipelineStrategy(data_parallel="zero3")
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=2 shards stages with FSDP2, but"):
        PipelineStrategy(data_parallel_shard_size=2)
    with pytest.raises(ValueError, match="pass only one of them"):
        PipelineStrategy(shard_optimizer_state=True, data_parallel="fsdp")
    with pytest.raises(TypeError, match="parallelize_fn must be a callable"):
        PipelineStrategy(parallelize_fn="fsdp")
    planned = resolve(PipelineStrategy(pipeline_size=2, data_parallel="fsdp"), devices=4, precision="32-true")
    assert planned.label() == "pp 2x2 1f1b m=4 +fsdp"  # the memory planner models it
    assert PipelineStrategy(shard_optimizer_state=True).parallel_plan.data_parallel == "zero1"
    assert PipelineStrategy(data_parallel="zero1").parallel_plan.shard_optimizer_state


def test_the_traced_path_refuses_what_its_stages_cannot_take_with_the_reason():
    cases = [
        (dict(parallelize_fn=lambda stage, mesh: None), r"parallelize_fn needs the stage modules of a split"),
        (
            dict(pipeline_size=1, stages_per_rank=2, schedule="interleaved_1f1b", data_parallel="fsdp"),
            r'data_parallel="fsdp" with stages_per_rank=2 is not supported for a traced forward',
        ),
    ]
    for kwargs, message in cases:
        trainer = quiet_trainer(
            devices=1, max_steps=1, strategy=PipelineStrategy(**{"pipeline_size": 1, **kwargs})
        )
        with pytest.raises(ValueError, match=message):
            trainer.fit(TinyGPT(), loader(token_data(8), 4))


class TiedRegressor(SequentialRegressor):
    def __init__(self):
        super().__init__(d_in=16, hidden=16, d_out=16, depth=5, adam=True)
        self.layers[-1].weight = self.layers[0][0].weight  # (the head shares the first layer's weight)


def test_a_weight_tied_between_two_stages_of_one_rank_is_refused_with_the_fix():
    """Each stage is its own FSDP2 root: two stages of one rank that use one weight would shard two copies
    of it, each taking part of its gradient (wrong weights, and a save failing on the copy without a
    name). Refused, on every rank alike (from the stage table), naming the weight and the fixes."""
    strategy = PipelineStrategy(
        pipeline_size=1, stages_per_rank=2, schedule="interleaved_1f1b", data_parallel="fsdp"
    )
    trainer = quiet_trainer(devices=1, max_steps=1, strategy=strategy)
    message = r"data_parallel=\"fsdp\" cannot shard 'layers.0.0.weight': stages \[0, 1\] use it .* rank 0"
    with pytest.raises(ValueError, match=message):
        trainer.fit(TiedRegressor(), loader(regression_data(16, d_in=16, d_out=16), 8))
    # The same tie on two ranks' stages (V on one rank, a loop over two) is FSDP2's as usual:
    # grads/tied.py sums the replicas' shards.
    params = [frozenset({"w", "a"}), frozenset({"b"}), frozenset({"c"}), frozenset({"d", "w"})]
    units, holds, sizes = [(str(i),) for i in range(4)], ["x"] * 4, [2] * 4
    looped = make_plan(units, holds, sizes, RankLayout(2, 2, 2), stage_parameters=params)
    refuse_shared_on_one_rank(looped)  # stages 0 and 3 on ranks 0 and 1
    v = make_plan(units, holds, sizes, RankLayout(2, 2, 2), stage_parameters=params, style="v")
    with pytest.raises(ValueError, match=r"cannot shard 'w': stages \[0, 3\] use it and pipeline rank 0"):
        refuse_shared_on_one_rank(v)


class SeesTheMesh(AdamRegressor):
    def configure_model(self):
        mesh = self.trainer.strategy.device_mesh
        self.seen = {"dims": mesh.mesh_dim_names, "shape": tuple(mesh.shape)}


def test_parallelize_fn_gets_each_stage_and_the_mesh_seen_in_configure_model(tmp_path):
    calls = []
    strategy = PipelineStrategy(
        pipeline_size=1, parallelize_fn=lambda stage, mesh: calls.append((type(stage).__name__, mesh.shape))
    )
    model = SeesTheMesh()
    quiet_trainer(devices=1, max_steps=1, strategy=strategy, default_root_dir=tmp_path).fit(
        model, loader(regression_data(16), 8)
    )
    assert model.seen == {"dims": ("pp", "dp_replicate", "dp_shard", "tp"), "shape": (1, 1, 1, 1)}
    assert calls == [("StageModule", (1, 1, 1, 1))]
    gradients = strategy.mesh.device_mesh_of("gradients")  # the replicate x shard ranks, flattened
    assert gradients.size() == 1 and gradients.mesh_dim_names == ("dp",)
    assert strategy.mesh.group("gradients") is not None
