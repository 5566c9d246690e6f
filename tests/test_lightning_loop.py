"""Lightning's loop around the strategy's step, timed by a one-device Trainer of its own."""

import logging

from lightning_parallel.strategies.pipeline.lightning_loop import loop_seconds


def test_the_loop_is_timed_per_step_and_per_batch_and_leaves_the_loggers_as_they_were():
    level = logging.getLogger("lightning.pytorch").level
    step, batch = loop_seconds((1, 3))
    assert 0.0 <= step < 1.0 and 0.0 <= batch < 1.0
    assert step + batch > 0  # (Lightning's hooks are never free)
    assert logging.getLogger("lightning.pytorch").level == level
