"""torchmetrics Metrics under a pipeline: updated on the last stage, synced over its replicas, read by all.

The user's step runs on the last stage, so a Metric's state grows there only. Each Metric of the module
is adapted once on every rank (:meth:`StageMetrics.adapt`):

* its sync gathers over this rank's data-parallel group: on the last stage, exactly the ranks that
  hold updates (once per ``compute()``, as torchmetrics syncs);
* ``compute()`` outside a step (where Lightning computes epoch values, and where epoch-end hooks call
  it) runs on the last stage and its value is broadcast to the other stages of the replica, which
  return it: every rank logs, and EarlyStopping or ModelCheckpoint read, the same value. Inside a step
  (or nested in another Metric's compute) it computes locally, as on one device.

In training the step runs once per micro-batch. :class:`BatchWindow` gives each Metric called there
(``metric(preds, target)``) the value over the whole batch as its step value, as one call over the
batch returns on one device. Pure PyTorch and torchmetrics, no Lightning.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.metric import CompositionalMetric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_parallel.distributed.agree import packed_error, unpacked_error
from lightning_parallel.distributed.collectives import broadcast_object
from lightning_parallel.pipeline._torchmetrics_internals import set_step_value
from lightning_parallel.pipeline.step_scope import StepScope

__all__ = ["BatchWindow", "StageMetrics"]


class StageMetrics:
    """This rank's adaptation of the module's Metrics (the strategy makes one at setup).

    Args:
        scope: marks the user's step code (inside it a Metric computes locally).
        group: the ranks a Metric's sync gathers over (``mesh.group("metrics")``): on the last stage,
            its data-parallel ranks.
        pp_group: this replica's pipeline ranks (``None``: no pipeline, nothing to broadcast).
        last_rank: the global rank of this replica's last stage, which computes.

    Example::

        metrics = StageMetrics(scope, mesh.group("metrics"), mesh.pp_group, last_rank=2)
        metrics.adapt_module(lightning_module)
        lightning_module.val_acc.compute()     # the last stage's value, on every stage
    """

    def __init__(self, scope: StepScope, group: Any, pp_group: Any | None, last_rank: int) -> None:
        self.scope, self.group, self.pp_group, self.last_rank = scope, group, pp_group, last_rank
        self.is_last = not torch.distributed.is_initialized() or torch.distributed.get_rank() == last_rank
        self.paths: dict[int, str] = {}  # id(metric) -> its path in the module (what Lightning logs it by)
        self.adapted: dict[int, Metric] = {}
        self._twins: dict[int, Metric] = {}
        self._depth = 0

    def adapt_module(self, module: nn.Module) -> None:
        """Adapt every Metric held anywhere in ``module`` (idempotent)."""
        for path, sub in module.named_modules():
            if isinstance(sub, Metric):
                self.paths.setdefault(id(sub), path)
                self.adapt(sub)

    def adapt(self, metric: Metric) -> Metric:
        """Sync ``metric`` over the data-parallel group; compute outside steps on the last stage only.

        The wrappers are instance attributes that name what they wrap: a metric adapted under an earlier
        Trainer is adapted afresh, not twice.
        """
        if id(metric) in self.adapted:
            return metric
        sync = _unwrapped(metric.dist_sync_fn) or gather_all_tensors
        metric.dist_sync_fn = _synced_over(sync, self.group)
        metric.compute = self._computed_everywhere(metric, _unwrapped(metric.compute))
        self.adapted[id(metric)] = metric
        return metric

    def window(self) -> BatchWindow:
        """A window over one training step's micro-batches (leaf Metrics only; see :class:`BatchWindow`)."""
        leaves = [m for m in self.adapted.values() if not isinstance(m, CompositionalMetric)]
        return BatchWindow(leaves, self._twins)

    def _computed_everywhere(self, metric: Metric, compute: Callable[..., Any]) -> Callable[..., Any]:
        @_wrapping(compute)
        def computed(*args: Any, **kwargs: Any) -> Any:
            if self.pp_group is None or self.scope.active or self._depth:
                return compute(*args, **kwargs)
            self._depth += 1  # the Metrics a CompositionalMetric or a collection computes stay local
            try:
                return self._from_last_stage(metric, lambda: compute(*args, **kwargs))
            finally:
                self._depth -= 1

        return computed

    def _from_last_stage(self, metric: Metric, compute: Callable[[], Any]) -> Any:
        value, error, sent = None, None, None
        if self.is_last:
            try:
                value = compute()
                sent = ("value", _to(value, torch.device("cpu")))
            except Exception as err:
                error, sent = err, ("error", packed_error(err))
        kind, payload = broadcast_object(sent, src=self.last_rank, group=self.pp_group)
        if kind == "error":
            raise error if error is not None else unpacked_error(payload)
        return value if self.is_last else _to(payload, metric.device)


class BatchWindow:
    """Each Metric called during one training step's micro-batches: its value over the whole batch.

    While :meth:`collecting`, every call ``metric(...)`` also updates a twin of the metric (a copy made at
    its first call, reset at each step) with the same inputs; :meth:`finish` then sets each called
    metric's step value (what Lightning logs on step) to its twin's ``compute()``: the metric over the
    batch's micro-batches together. The twin syncs only if the metric has ``dist_sync_on_step=True``, as
    ``forward`` does. The cost: a metric called in a step is updated twice per micro-batch.

    Example::

        window = metrics.window()
        with window.collecting():
            run_the_micro_batches()      # the user's step calls self.acc(preds, y) once per micro-batch
        window.finish()                  # self.acc's step value: the accuracy over the whole batch
    """

    def __init__(self, metrics: list[Metric], twins: dict[int, Metric] | None = None) -> None:
        self.metrics = metrics
        self.twins = {} if twins is None else twins  # id(metric) -> its twin, kept from step to step
        self._called: list[tuple[Metric, Metric]] = []

    @contextmanager
    def collecting(self) -> Iterator[None]:
        called: dict[int, tuple[Metric, Metric]] = {}
        for metric in self.metrics:
            metric.forward = self._tee(metric, metric.forward, called)
        try:
            yield
        finally:
            for metric in self.metrics:
                del metric.forward
            self._called = list(called.values())

    def finish(self) -> None:
        for metric, twin in self._called:
            set_step_value(metric, twin.compute())

    def _tee(self, metric: Metric, forward: Callable, called: dict) -> Callable:
        def tee(*args: Any, **kwargs: Any) -> Any:
            if id(metric) not in called:  # the first call of this step
                called[id(metric)] = (metric, self._reset_twin(metric))
            out = forward(*args, **kwargs)
            called[id(metric)][1].update(*args, **kwargs)
            return out

        return tee

    def _reset_twin(self, metric: Metric) -> Metric:
        """The metric's twin, reset; made at the metric's first call (a metric never called has none)."""
        twin = self.twins.get(id(metric))
        if twin is None:
            # The copy computes with torchmetrics' own compute (torchmetrics does not copy ``compute``).
            twin = self.twins[id(metric)] = _copy_without_hooks(metric)
            twin.__dict__.pop("forward", None)  # this window's stand-in
            if not metric.dist_sync_on_step:
                twin.distributed_available_fn = _never
        twin.reset()
        return twin


def replay_step_value(metric: Metric, value: torch.Tensor | None) -> None:
    """Make ``value`` what Lightning logs as ``metric``'s step value at its next ``self.log(name, metric)``:
    on a stage that did not run the step, the value the last stage computed."""
    set_step_value(metric, value)


def _copy_without_hooks(metric: Metric) -> Metric:
    """A deep copy of ``metric`` without the module hooks others put on it (a profiler's do not copy)."""
    memo: dict[int, Any] = {}
    for module in metric.modules():
        for name, value in vars(module).items():
            if name.endswith("hooks") and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(metric, memo)


def _never() -> bool:
    return False


def _synced_over(sync: Callable[..., Any], group: Any) -> Callable[..., Any]:
    """``sync`` (torchmetrics calls it as ``sync(tensor, group=...)``) over ``group`` unless told another."""

    @_wrapping(sync)
    def synced(tensor: torch.Tensor, group_: Any = None, **kwargs: Any) -> Any:
        return sync(tensor, group=kwargs.pop("group", group_) or group, **kwargs)

    return synced


def _wrapping(inner: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def mark(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        wrapper._lp_wrapped = inner  # type: ignore[attr-defined]
        return wrapper

    return mark


def _unwrapped(fn: Any) -> Any:
    while fn is not None and hasattr(fn, "_lp_wrapped"):
        fn = fn._lp_wrapped
    return fn


def _to(tree: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x, tree)
