"""ModelSummary under PipelineStrategy: the table of the whole model, taken before the split.

Lightning's ``ModelSummary`` callback summarises ``pl_module`` at ``on_fit_start``, after the strategy's
``setup``, when each rank holds one stage. The strategy summarises the whole module in ``setup`` before
splitting it, on global rank 0 (which prints the table), keeping numbers and strings only, and has the
callback print that summary.

Lightning 2.6.6 private names, used here only: the callback's ``_summary(trainer, pl_module)`` method
(replaced per callback instance, never on the class) and ``_max_depth``, and the summary's
``_get_summary_data()``. ``tests/test_pipeline_idioms.py::test_summary_internals_are_where_we_expect``
fails loudly if they move.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import summarize


class WholeModelSummary:
    """What ``ModelSummary.on_fit_start`` reads of a summary, frozen from the unsplit module.

    Example::

        frozen = WholeModelSummary(summarize(module, max_depth=1))
        frozen.total_parameters            # the whole model's, after the split too
    """

    def __init__(self, summary: Any) -> None:
        self._data = summary._get_summary_data()
        self.total_parameters = summary.total_parameters
        self.trainable_parameters = summary.trainable_parameters
        self.model_size = summary.model_size
        self.total_training_modes = summary.total_training_modes
        self.total_flops = summary.total_flops

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self._data


def summarize_before_split(trainer: pl.Trainer, module: pl.LightningModule, strategy: Any) -> None:
    """Have each ModelSummary callback print the whole module's table in this fit (global rank 0)."""
    if not trainer.is_global_zero:
        return  # the other ranks summarise their stage and print nothing
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary) and callback._max_depth:
            frozen = WholeModelSummary(summarize(module, max_depth=callback._max_depth))
            callback._summary = _summary_in(strategy, frozen, callback)


def _summary_in(strategy: Any, frozen: WholeModelSummary, callback: ModelSummary) -> Any:
    def summary(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        if trainer.strategy is strategy:
            return frozen
        return type(callback)._summary(callback, trainer, pl_module)  # the callback, reused elsewhere

    return summary
