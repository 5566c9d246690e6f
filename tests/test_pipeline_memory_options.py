"""PipelineStrategy(activation_checkpointing=...): the names and kinds of selections it refuses.

Recomputation and ZeRO-1 (shard_optimizer_state / data_parallel="zero1") in every configuration, with
every other technique and a scheduler driving the optimizer, against one device (each replica's share
of the state, every unit recomputed, checkpoints resumed at other shapes and on one device) are cases of
the configuration matrix (tests/matrix.py, run by tests/test_matrix.py).
"""

import pytest
from mp_harness import quiet_trainer
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy

N_SAMPLES = 48


def test_activation_checkpointing_names_are_checked_against_the_whole_sequential():
    trainer = quiet_trainer(
        devices=1, max_steps=1,
        strategy=PipelineStrategy(pipeline_size=1, activation_checkpointing=["layers.1", "layers.9"]),
    )  # fmt: skip
    match = r"do not exist: \['layers.9'\]; the units are \['layers.0', 'layers.1'"
    with pytest.raises(ValueError, match=match):
        trainer.fit(SequentialRegressor(hidden=32, depth=5), loader(regression_data(N_SAMPLES), 8))


def test_activation_checkpointing_names_are_checked_against_the_traced_units():
    strategy = PipelineStrategy(pipeline_size=1, num_microbatches=2, activation_checkpointing=["h.1", "h.9"])
    trainer = quiet_trainer(devices=1, max_steps=1, strategy=strategy)
    units = "'wte', 'wpe', 'h.0', 'h.1', 'h.2', 'h.3', 'ln_f', 'lm_head'"
    match = rf"do not exist: \['h.9'\]; the units are \[{units}\]"
    with pytest.raises(ValueError, match=match):
        trainer.fit(TinyGPT(), loader(token_data(16), 8))


@pytest.mark.parametrize("bad", ["layers.1", 3, [1, 2]])
def test_activation_checkpointing_of_the_wrong_type_fails_at_construction(bad):
    with pytest.raises(TypeError, match="activation_checkpointing must be True/False, a callable"):
        PipelineStrategy(activation_checkpointing=bad)
