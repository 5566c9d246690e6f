"""The one private torchmetrics name the pipeline uses: a Metric's step value, ``_forward_cache``.

Checked against torchmetrics 1.9 and Lightning 2.6.6: ``Metric.forward`` stores the batch value it
returns in ``_forward_cache`` (``reset()`` sets it to ``None``), and Lightning logs a Metric's step value
by reading that attribute (``_ResultMetric.update``). No public API sets it. The pipeline sets it to the
value over a whole batch (its micro-batches ran the step one by one) and, on the stages that never run
the step, to the last stage's value.
``tests/test_pipeline_metrics.py::test_torchmetrics_internals_are_where_we_expect`` fails loudly if it moves.
"""

from __future__ import annotations

from typing import Any


def step_value(metric: Any) -> Any:
    """The value of the metric's last ``forward`` since its last ``reset`` (``None`` if none)."""
    return metric._forward_cache


def set_step_value(metric: Any, value: Any) -> None:
    """What Lightning logs as the metric's step value at the next ``self.log(name, metric)``."""
    metric._forward_cache = value
