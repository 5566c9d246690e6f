"""AllReducedMetrics: every ``self.log`` value reaches rank 0's logger as the value over all ranks."""

import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.callbacks._metrics_internals import (
    _attach_to_lightning_internals,
    _current_results,
    _lightning_batch_size,
    _train_step_is_logged,
)
from lightning_parallel.distributed.collectives import (
    ScalarReducer,
    distributed_ready,
    match_reduce_op,
    min_over_ranks,
    validate_reduce_map,
)

__all__ = ["AllReducedMetrics"]

_SEP = "\x1f"
# rank_stats/<stat>_<min|mean|max>: each rank logs its own number three times, reduced three ways.
_RANK_STATS_REDUCE = {"rank_stats/*_min": "min", "rank_stats/*_max": "max", "rank_stats/*_mean": "mean"}


@dataclass
class _Shown:
    """A reduced value and where Lightning shows it (names and flags of the rank that logged it)."""

    value: float
    tensor: torch.Tensor
    name: str
    forked: str
    logger: bool
    prog_bar: bool
    fx: str
    dataloader_idx: int | None


@dataclass
class _CollectionSync:
    """Per ``_ResultCollection`` state: its reducer, the step values since the last sync, the cache."""

    reducer: ScalarReducer
    pending: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)
    cache: dict[tuple[str, str], _Shown] = field(default_factory=dict)
    keys: dict[tuple[int, str], str] = field(default_factory=dict)  # (id(metric), view) -> layout key


class AllReducedMetrics(Callback):
    """Reduce every logged scalar over all ranks in one collective per logging step.

    With this callback, ``self.log`` / ``self.log_dict`` (no ``sync_dist`` needed) reach the logger, the
    progress bar and ``trainer.callback_metrics`` as the value over every rank of the data-parallel
    group: the mean weighted by the samples behind each rank's value (``batch_size``, inferred as
    Lightning does), or the reduction the metric was logged with (``reduce_fx="sum"/"max"/"min"``), or
    the one ``reduce`` names for it. All scalars of a step travel in one ``all_gather`` (see
    :class:`~lightning_parallel.distributed.collectives.ScalarReducer`), only on the steps Lightning
    writes to the logger (``log_every_n_steps``), plus one per epoch end. ``sync_dist=True`` in user code
    is neutralised (no second reduction, no per-metric collective). ``torchmetrics.Metric`` objects are
    left to sync themselves. A metric logged on some ranks only is reduced over those ranks.

    Under DDP, validation and test loaders with a sequential sampler get an
    :class:`~lightning_parallel.data.eval_sampler.EvalDistributedSampler` (no padded duplicates), so
    evaluating N samples on W ranks gives the one-device result when N is not a multiple of W.

    Reads before a step's sync point (the progress bar during ``on_train_batch_end``) show the latest
    reduced value, i.e. that of the previous logging step.

    Args:
        reduce: ``{metric name or glob: "mean" | "sum" | "max" | "min"}`` across ranks, e.g.
            ``{"tokens": "sum", "*_max": "max"}``; an exact name wins over globs, globs in order.
        rank_stats: also log each rank's step time (s) and peak memory (MB; CUDA allocator peak, or the
            process's peak RSS on CPU) as ``rank_stats/{step_time_s,peak_mem_mb}_{min,mean,max}``.
        exact_eval: use the non-padding evaluation sampler under DDP (see above).
        allow_nonfinite: reduce NaN/inf like numbers; by default a non-finite value raises a
            ``ValueError`` naming the metric and the ranks, on every rank.

    Raises:
        TypeError: ``reduce`` is not a mapping of str to str.
        ValueError: an unknown reduction in ``reduce``.

    Example::

        trainer = L.Trainer(devices=8, strategy="ddp",
                            callbacks=[AllReducedMetrics(reduce={"tokens": "sum"}, rank_stats=True)])
        # in the LightningModule, unchanged:
        self.log("train_loss", loss)
        self.log_dict({"acc": acc, "tokens": n_tokens}, batch_size=len(x))
    """

    @checks_options
    def __init__(
        self,
        reduce: Mapping[str, str] | None = None,
        rank_stats: bool = False,
        exact_eval: bool = True,
        allow_nonfinite: bool = False,
    ) -> None:
        self.reduce = (
            {**_RANK_STATS_REDUCE, **validate_reduce_map(reduce)}
            if rank_stats
            else (validate_reduce_map(reduce))
        )
        self.rank_stats = rank_stats
        self.exact_eval = exact_eval
        self.allow_nonfinite = allow_nonfinite
        self._group: Any = None
        self._device = torch.device("cpu")
        self._states: dict[int, _CollectionSync] = {}
        self._undo: Callable[[], None] | None = None
        self._epoch_synced = False
        self._eval_min_batches: list[float] = []
        self._eval_position: tuple[int, int] = (0, 0)
        self._step_start = 0.0

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._group = getattr(trainer.strategy, "data_parallel_group", None)
        if distributed_ready() and torch.distributed.get_backend(self._group) == "nccl":
            self._device = trainer.strategy.root_device
        self._states = {}
        if self._undo is None:
            self._undo = _attach_to_lightning_internals(trainer, pl_module, self)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.rank_stats:
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.rank_stats:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the GPU's time, not the launch time
            peak_mb = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        else:
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
        dt = time.perf_counter() - self._step_start
        for stat, value in (("step_time_s", dt), ("peak_mem_mb", peak_mb)):
            for how in ("min", "mean", "max"):
                pl_module.log(
                    f"rank_stats/{stat}_{how}", float(value), on_step=True, on_epoch=False, batch_size=1
                )

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._agree_eval_lengths(trainer, trainer.num_val_batches)

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._agree_eval_lengths(trainer, trainer.num_test_batches)

    @override
    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_position = (dataloader_idx, batch_idx)

    @override
    def on_test_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_position = (dataloader_idx, batch_idx)

    # ------------------------------------------------------------------ decisions (same on every rank)

    def _agree_eval_lengths(self, trainer: L.Trainer, lengths: list[int | float]) -> None:
        """Eval shards may differ by one batch: sync a step only where every rank runs it."""
        if trainer.sanity_checking:
            return
        self._eval_min_batches = min_over_ranks([float(n) for n in lengths], self._group, self._device)

    def _step_sync_due(self, trainer: L.Trainer) -> bool:
        if trainer.sanity_checking:
            return False
        if trainer.training:
            return _train_step_is_logged(trainer)
        dl, idx = self._eval_position
        return dl < len(self._eval_min_batches) and idx < self._eval_min_batches[dl]

    # ------------------------------------------------------------------ the reduction

    def _state(self, results: Any) -> _CollectionSync:
        key = id(results)
        if key not in self._states:
            reducer = ScalarReducer(
                self._group, self._device, allow_nonfinite=self.allow_nonfinite, label=_describe_metric
            )
            self._states[key] = _CollectionSync(reducer)
        return self._states[key]

    def _record(self, results: Any, storage_key: str, value: Any, batch_size: int | None) -> None:
        """Keep this step's value and weight of a scalar just logged (Lightning keeps no step weight)."""
        metric = results[storage_key]
        if not metric.is_tensor:
            return
        weight = 1.0
        if metric.meta.is_mean_reduction:
            weight = float(batch_size if batch_size is not None else _lightning_batch_size(results))
        self._state(results).pending[storage_key] = (torch.as_tensor(value).detach(), weight)

    def _sync(self, trainer: L.Trainer, views: tuple[str, ...]) -> None:
        results = _current_results(trainer)
        state = self._state(results)
        keys, values, weights, ops = [], [], [], []
        for storage_key, metric in results.valid_items():
            if not metric.is_tensor:
                continue  # torchmetrics objects sync themselves
            op = match_reduce_op(metric.meta.name, self.reduce, _lightning_op(metric.meta))
            for view, value, weight in _views_of(metric, storage_key, state.pending, views):
                layout_key = state.keys.get((id(metric), view))
                if layout_key is None:
                    layout_key = state.keys[(id(metric), view)] = _layout_key(
                        results, metric, storage_key, view
                    )
                keys.append(layout_key)
                values.append(value)
                weights.append(weight)
                ops.append(op)
        if "step" in views:
            state.pending.clear()
        numbers = (
            torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()).cpu() for v in values])
            if values
            else torch.zeros(0)
        )
        entries = {k: (v, w, op) for k, v, w, op in zip(keys, numbers.tolist(), weights, ops)}
        for key, reduced in state.reducer.reduce(entries).items():
            shown = _parse_layout_key(key, reduced.value)
            state.cache[(key.split(_SEP, 1)[0], key.split(_SEP)[1])] = shown

    def _overlay(self, results: Any, on_step: bool, out: dict[str, dict[str, Any]]) -> None:
        """Replace the local values in Lightning's metric dicts by the latest reduced ones."""
        view = "step" if on_step else "epoch"
        state = self._states.get(id(results))
        if state is None:
            return
        for (cached_view, storage_key), shown in state.cache.items():
            metric = results.get(storage_key)
            if cached_view != view or shown.dataloader_idx != results.dataloader_idx:
                continue
            if metric is not None and (metric.has_reset or not metric.is_tensor):
                continue
            value = shown.tensor
            if shown.logger:
                out["log"][shown.forked] = value
            if results.training or view == "epoch":
                out["callback"][shown.name] = out["callback"][shown.forked] = value
            if shown.prog_bar:
                out["pbar"][shown.forked] = shown.value

    def _forget(self, results: Any, metrics: bool | None, fx: str | None) -> None:
        """Lightning reset (some of) the collection's tensors: drop their reduced values too."""
        state = self._states.get(id(results))
        if state is None or metrics is True:
            return
        state.cache = {k: s for k, s in state.cache.items() if fx is not None and s.fx != fx}
        if fx is None:  # a whole reset happens at the same point on every rank (an epoch end)
            state.pending.clear()
            state.keys.clear()
            state.reducer.reset_layout()


def _views_of(
    metric: Any, storage_key: str, pending: Mapping[str, tuple[torch.Tensor, float]], views: tuple[str, ...]
) -> list[tuple[str, Any, float]]:
    out = []
    if "step" in views and metric.meta.on_step and storage_key in pending:
        value, weight = pending[storage_key]
        out.append(("step", value, weight))
    if "epoch" in views and metric.meta.on_epoch:
        if metric.meta.is_mean_reduction:
            count = float(metric.cumulated_batch_size)
            out.append(("epoch", metric.value / max(count, 1.0), count))
        else:
            out.append(("epoch", metric.value, 1.0))
    return out


def _lightning_op(meta: Any) -> str:
    if meta.is_sum_reduction:
        return "sum"
    if meta.is_max_reduction:
        return "max"
    return "min" if meta.is_min_reduction else "mean"


def _layout_key(results: Any, metric: Any, storage_key: str, view: str) -> str:
    name, forked = results._forked_name(metric, view == "step")
    m = metric.meta
    dl = "" if m.dataloader_idx is None else str(m.dataloader_idx)
    return _SEP.join([view, storage_key, name, forked, f"{int(m.logger)}{int(m.prog_bar)}", m.fx, dl])


def _describe_metric(key: str) -> str:
    """How the reducer's errors name a metric: ``metric 'loss' (step value, logged in training_step)``."""
    view, _, _, forked, _, fx, _ = key.split(_SEP)
    return f"metric {forked!r} ({view} value, logged in {fx})"


def _parse_layout_key(key: str, value: float) -> _Shown:
    _, _, name, forked, flags, fx, dl = key.split(_SEP)
    return _Shown(
        value,
        torch.tensor(value, dtype=torch.float32),
        name,
        forked,
        flags[0] == "1",
        flags[1] == "1",
        fx,
        int(dl) if dl else None,
    )
