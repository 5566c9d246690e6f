"""Record what a step logs per micro-batch, combine it into one value per batch, replay it elsewhere.

Under the pipeline the user's step runs on the last stage once per micro-batch, while the logger lives
on global rank 0. The strategy records each ``self.log`` call, combines the micro-batches the way one
call over the whole batch would have logged (weighted by samples, or by the reduction the user asked
for), sends the result to the other stages, and replays it there through the real ``self.log``.

A torchmetrics ``Metric`` logged in the step is recorded by its path in the module: its state stays on the
last stage; what travels is its step value (what Lightning logs on step), and every stage logs its own
copy of the metric, whose ``compute()`` returns the last stage's value (:mod:`.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torchmetrics import Metric, MetricCollection

from lightning_parallel.pipeline._torchmetrics_internals import step_value


@dataclass(frozen=True)
class LoggedMetric:
    """What a logged ``Metric`` is sent as: its path in the module and its step value (``None``: none yet)."""

    path: str
    value: float | None


@dataclass
class LoggedValue:
    """All micro-batch values of one logged name, with the keyword arguments of its first call.

    ``metric`` / ``path``: a logged torchmetrics ``Metric`` and where the module holds it.
    """

    name: str
    kwargs: dict[str, Any]
    values: list[float | torch.Tensor] = field(default_factory=list)  # tensors: read once, when combined
    weights: list[float] = field(default_factory=list)  # what each value counts for in the batch's mean
    samples: list[float] = field(default_factory=list)  # the batch size each was logged with
    metric: Metric | None = None
    path: str | None = None

    def combined(self) -> float | None:
        if self.metric is not None:
            return _metric_step_value(self.name, self.metric)
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
        if self.metric is not None:  # Lightning reads no batch size for a Metric
            return kwargs
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

    def __init__(self, metric_paths: dict[int, str] | None = None) -> None:
        self._entries: dict[str, LoggedValue] = {}
        self._samples = 0.0
        self._weight = 0.0
        self._module: torch.nn.Module | None = None
        self.metric_paths = {} if metric_paths is None else metric_paths  # id(metric) -> path in the module

    @contextmanager
    def recording(
        self, module: torch.nn.Module, samples: float, weight: float | None = None
    ) -> Iterator[None]:
        """Record ``module``'s ``self.log`` calls of one (micro-)batch of ``samples``, its values counting
        ``weight`` in the batch's mean (its items: labelled tokens; default: its samples)."""
        self._samples, self._weight = samples, samples if weight is None else weight
        self._module = module
        # An instance attribute shadows LightningModule.log (log_dict calls self.log, so it is
        # covered too); deleting it restores the real method.
        module.log = self.log
        try:
            yield
        finally:
            del module.log

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        if isinstance(value, Metric):
            self._log_metric(name, value, kwargs)
            return
        if isinstance(value, MetricCollection):
            raise TypeError(
                f"self.log({name!r}, <MetricCollection>): log a collection with self.log_dict(collection)"
            )
        if not (torch.is_tensor(value) or isinstance(value, (int, float))):
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) under PipelineStrategy: log a tensor, a "
                f"number or a torchmetrics Metric"
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

    def _log_metric(self, name: str, metric: Metric, kwargs: dict[str, Any]) -> None:
        entry = self._entries.get(name)
        if entry is None:
            path = kwargs.pop("metric_attribute", None) or self._path_of(metric, name)
            self._entries[name] = LoggedValue(name, kwargs, metric=metric, path=path)

    def _path_of(self, metric: Metric, name: str) -> str:
        path = self.metric_paths.get(id(metric))
        if path is None and self._module is not None:
            path = next((p for p, m in self._module.named_modules() if m is metric), None)
        if path is None:
            raise TypeError(
                f"self.log({name!r}, <{type(metric).__name__}>): the metric is not held by the "
                f"LightningModule. Set it as an attribute (self.acc = {type(metric).__name__}(...)), or "
                f"pass metric_attribute= naming the module attribute that holds it"
            )
        self.metric_paths[id(metric)] = path
        return path


def to_record(entries: list[LoggedValue], *leading: float) -> tuple[tuple, list[float]]:
    """``(layout, values)`` of combined log entries, to send to the other stages: see :func:`from_record`.

    The layout (names, options, metric paths) changes rarely; the values (``leading`` numbers such as the
    loss, then two per entry: its value and sample count, or a metric's step value and whether it has
    one) change every step.
    """
    layout = tuple((e.name, e.kwargs, "batch_size" in e.replay_kwargs(), e.path) for e in entries)
    values = list(leading)
    for e in entries:
        if e.metric is not None:
            value = e.combined()
            values += [0.0, 0.0] if value is None else [value, 1.0]
        else:
            values += [e.combined(), float(sum(e.samples))]
    return layout, values


def from_record(layout: tuple, values: list[float], leading: int = 0) -> tuple[list[float], list[tuple]]:
    """The ``leading`` numbers and ``(name, value, log kwargs)`` per entry, from :func:`to_record`.

    A logged Metric's value is a :class:`LoggedMetric`.
    """
    logs: list[tuple[str, Any, dict[str, Any]]] = []
    for i, (name, kwargs, with_batch_size, path) in enumerate(layout):
        value, samples = values[leading + 2 * i], values[leading + 2 * i + 1]
        if path is not None:
            logs.append((name, LoggedMetric(path, value if samples else None), dict(kwargs)))
            continue
        logs.append(
            (name, value, {**kwargs, "batch_size": int(samples)} if with_batch_size else dict(kwargs))
        )
    return values[:leading], logs


def _metric_step_value(name: str, metric: Metric) -> float | None:
    value = step_value(metric)
    if value is None:
        return None
    if not torch.is_tensor(value) or value.numel() != 1:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(
            f"self.log({name!r}, <{type(metric).__name__}>) logs the metric's value on step, which is not a "
            f"scalar ({shape}): log a metric whose compute() returns one number"
        )
    return float(value)


def _numbers(values: list[float | torch.Tensor]) -> list[float]:
    """Plain numbers; the tensors among them read in one transfer (one device sync, not one per value)."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack(tensors).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """The mean of ``values`` weighted by ``weights``; values of weight 0 (a NaN loss of no items) skipped."""
    kept = [(v, w) for v, w in zip(values, weights) if w]
    if not kept:
        return float("nan")
    return sum(v * w for v, w in kept) / sum(w for _, w in kept)
