"""strategies/pipeline/build.py: the source and the plan chosen from the module, in one process (no
pipeline run).

Covers strategies/pipeline/call_input.py (the first batch read at setup), sources/stage_plan.py (costs
measured, stages planned), sources/sequential/source.py and sources/traced/source.py (both split
paths, each handing back a sources/split_result.py) through Trainer.fit.
"""

import pytest
from mp_harness import quiet_trainer
from test_profile import uneven_layers
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy


class UnevenRegressor(SequentialRegressor):
    def __init__(self):
        super().__init__()
        self.layers = uneven_layers()


def test_time_partition_end_to_end_prints_a_plan_from_the_first_batch():
    strategy = PipelineStrategy(
        pipeline_size=1, stages_per_rank=2, schedule="interleaved_1f1b", partition="time"
    )
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=1)
    trainer.fit(UnevenRegressor(), loader(regression_data(), 8))
    assert strategy.plan is not None and strategy.plan.cost_unit == "ms fwd+bwd"
    assert "cost (ms fwd+bwd)" in strategy.plan.format_table()
    # Lightning 2.6.6 keeps each loop's loader where _first_batch reads it; fail loudly if not.
    for loop in (trainer.fit_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        assert hasattr(loop, "_data_source")


def test_a_module_without_sequential_is_traced_and_planned_at_its_blocks():
    strategy = PipelineStrategy(pipeline_size=1)
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=1)
    trainer.fit(TinyGPT(depth=3), loader(token_data(16), 8))
    plan = strategy.plan
    assert plan is not None and plan.source == "TinyGPT.forward (traced)"
    assert plan.stages[0].holds == "wte, wpe, h.0-2, ln_f, lm_head"
    assert plan.total_parameters() == sum(p.numel() for p in TinyGPT(depth=3).parameters())


def test_interleaving_a_traced_module_on_one_pipeline_rank_is_refused():
    strategy = PipelineStrategy(pipeline_size=1, stages_per_rank=2, schedule="interleaved_1f1b")
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=1)
    with pytest.raises(ValueError, match="stages_per_rank=2 on one pipeline rank"):
        trainer.fit(TinyGPT(), loader(token_data(16), 8))
