"""Record what a step logs per micro-batch, combine it into one value per batch, replay it elsewhere.

Under the pipeline the user's step runs on the last stage once per micro-batch, while the logger lives
on global rank 0. The strategy records each ``self.log`` call, combines the micro-batches the way one
call over the whole batch would have logged (weighted by samples, or by the reduction the user asked
for), sends the result to the other stages, and replays it there through the real ``self.log``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_parallel.pipeline.item_weights import weighted_mean


@dataclass
class LoggedValue:
    """All micro-batch values of one logged name, with the keyword arguments of its first call."""

    name: str
    kwargs: dict[str, Any]
    values: list[float | torch.Tensor] = field(default_factory=list)  # tensors: read once, when combined
    weights: list[float] = field(default_factory=list)  # what each value counts for in the batch's mean
    samples: list[float] = field(default_factory=list)  # the batch size each was logged with

    def combined(self) -> float:
        values = _numbers(self.values)
        reduce = str(self.kwargs.get("reduce_fx", "mean")).lower()
        if reduce in ("sum", "add"):
            return float(sum(values))
        if reduce == "max":
            return float(max(values))
        if reduce == "min":
            return float(min(values))
        return weighted_mean(values, self.weights)

    def replay_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.kwargs)
        if "batch_size" in kwargs or len(self.samples) > 1:
            kwargs["batch_size"] = int(sum(self.samples))
        return kwargs


class LogRecorder:
    """Stands in for ``LightningModule.log`` while the user's step runs on micro-batches.

    Example::

        recorder = LogRecorder()
        with recorder.recording(module, samples=4):
            module.training_step(chunk, 0)      # self.log(...) calls land in the recorder
        recorder.entries()                      # one combined value per name
    """

    def __init__(self) -> None:
        self._entries: dict[str, LoggedValue] = {}
        self._samples = 0.0
        self._weight = 0.0

    @contextmanager
    def recording(
        self, module: torch.nn.Module, samples: float, weight: float | None = None
    ) -> Iterator[None]:
        """Record ``module``'s ``self.log`` calls of one (micro-)batch of ``samples``, its values counting
        ``weight`` in the batch's mean (its items: labelled tokens; default: its samples)."""
        self._samples, self._weight = samples, samples if weight is None else weight
        # An instance attribute shadows LightningModule.log (log_dict calls self.log, so it is
        # covered too); deleting it restores the real method.
        module.log = self.log
        try:
            yield
        finally:
            del module.log

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        if not (torch.is_tensor(value) or isinstance(value, (int, float))):
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) under PipelineStrategy: log a tensor or a "
                f"number (for a torchmetrics Metric, log the tensor it returns or its compute())"
            )
        if torch.is_tensor(value):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}: log scalars"
                )
            # Kept on its device and read when the batch's value is combined: an .item() here would
            # stall the schedule (a device sync) once per logged name and micro-batch.
            value = value.detach().reshape(()).float().clone()
        else:
            value = float(value)
        given = kwargs.get("batch_size")
        entry = self._entries.setdefault(name, LoggedValue(name, kwargs))
        entry.values.append(value)
        entry.weights.append(float(given or self._weight))
        entry.samples.append(float(given or self._samples))

    def entries(self) -> list[LoggedValue]:
        return list(self._entries.values())


def to_record(entries: list[LoggedValue], *leading: float) -> tuple[tuple, list[float]]:
    """``(layout, values)`` of combined log entries, to send to the other stages: see :func:`from_record`.

    The layout (names and options) changes rarely; the values (``leading`` numbers such as the loss,
    then each entry's value and sample count) change every step.
    """
    layout = tuple((e.name, e.kwargs, "batch_size" in e.replay_kwargs()) for e in entries)
    values = list(leading)
    for e in entries:
        values += [e.combined(), float(sum(e.samples))]
    return layout, values


def from_record(layout: tuple, values: list[float], leading: int = 0) -> tuple[list[float], list[tuple]]:
    """The ``leading`` numbers and ``(name, value, log kwargs)`` per entry, from :func:`to_record`."""
    logs = []
    for i, (name, kwargs, with_batch_size) in enumerate(layout):
        value, samples = values[leading + 2 * i], values[leading + 2 * i + 1]
        logs.append(
            (name, value, {**kwargs, "batch_size": int(samples)} if with_batch_size else dict(kwargs))
        )
    return values[:leading], logs


def _numbers(values: list[float | torch.Tensor]) -> list[float]:
    """Plain numbers; the tensors among them read in one transfer (one device sync, not one per value)."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack(tensors).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]
