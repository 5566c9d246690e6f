"""The Lightning 2.6.6 private state AllReducedMetrics wraps, isolated from the callback's logic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import lightning as L
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, SequentialSampler

from lightning_parallel.data.eval_sampler import EvalDistributedSampler


class _SyncHooks(Protocol):
    """What the wrapped Lightning methods call back into: AllReducedMetrics provides it.

    Declared here, so this module does not import the callback's module (which imports this one).
    """

    exact_eval: bool
    _epoch_synced: bool

    def _step_sync_due(self, trainer: L.Trainer) -> bool: ...

    def _sync(self, trainer: L.Trainer, views: tuple[str, ...]) -> None: ...

    def _record(self, results: Any, storage_key: str, value: Any, batch_size: int | None) -> None: ...

    def _overlay(self, results: Any, on_step: bool, out: dict[str, dict[str, Any]]) -> None: ...

    def _forget(self, results: Any, metrics: bool | None, fx: str | None) -> None: ...


def _no_sync(value: Any, *args: Any, **kwargs: Any) -> Any:
    return value


# ---------------------------------------------------------------------- Lightning private state
#
# Checked against Lightning 2.6.6; test_metrics.py::test_lightning_internals_are_where_we_expect fails
# loudly if any of these move. No public hook sees the logged values between ``self.log`` and the
# logger, so the callback wraps, per trainer and undone at teardown (never at import, never globally):
#   * ``_ResultCollection.log`` of each loop: records each step's value and weight, and replaces
#     ``sync_dist`` by a no-op sync (no per-metric collective, no double reduction, no warning);
#   * ``_ResultCollection.metrics`` / ``reset``: overlays the reduced values / forgets them on reset;
#   * ``_LoggerConnector.on_batch_end`` / ``on_epoch_end`` / ``epoch_end_reached`` /
#     ``update_eval_epoch_metrics``: the sync points, reached by every rank in the same order;
#   * ``LightningModule.on_train_epoch_end`` (the instance's): a sync point after the user's epoch-end
#     logging and before EarlyStopping / ModelCheckpoint read ``callback_metrics``;
#   * ``_DataConnector._prepare_dataloader``: the evaluation sampler without padding;
#   * read only: ``_ResultCollection.batch`` / ``batch_size``, the step's samples (``_lightning_batch_size``).


def _current_results(trainer: L.Trainer) -> Any:
    return trainer._results


def _lightning_batch_size(results: Any) -> int:
    """The samples behind this step's values, found as ``_ResultCollection._extract_batch_size`` does.

    ``self.log(batch_size=...)`` of this step if given, else the size Lightning infers from the batch,
    else 1: a rank's step value then weighs in the mean over ranks as it does in Lightning's epoch mean.
    """
    if results.batch_size is not None:
        return results.batch_size
    if results.batch is None:
        return 1
    try:
        return extract_batch_size(results.batch)
    except Exception:  # Lightning raises MisconfigurationException when it finds no tensor
        return 1


def _train_step_is_logged(trainer: L.Trainer) -> bool:
    """The condition of ``_LoggerConnector.update_train_step_metrics`` (Lightning 2.6.6)."""
    if trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization:
        return False
    return trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)


def _attach_to_lightning_internals(
    trainer: L.Trainer, pl_module: L.LightningModule, cb: _SyncHooks
) -> Callable[[], None]:
    """Wrap the private methods listed above on this trainer's objects; return the undo function."""
    undo: list[Callable[[], None]] = []

    def wrap(obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        object.__setattr__(obj, name, make(getattr(obj, name)))
        undo.append(lambda: object.__setattr__(obj, name, old) if had else object.__delattr__(obj, name))

    loops = [
        trainer.fit_loop.epoch_loop,
        trainer.fit_loop.epoch_loop.val_loop,
        trainer.validate_loop,
        trainer.test_loop,
    ]
    for results in {id(loop._results): loop._results for loop in loops}.values():
        wrap(results, "log", lambda orig, r=results: _wrapped_log(orig, r, cb))
        wrap(results, "metrics", lambda orig, r=results: _wrapped_metrics(orig, r, cb))
        wrap(results, "reset", lambda orig, r=results: _wrapped_reset(orig, r, cb))
    conn = trainer._logger_connector
    wrap(
        conn,
        "on_batch_end",
        lambda orig: _before(
            orig, lambda: cb._step_sync_due(trainer) and cb._sync(trainer, ("step", "epoch"))
        ),
    )
    wrap(conn, "epoch_end_reached", lambda orig: _before(orig, lambda: setattr(cb, "_epoch_synced", False)))
    wrap(conn, "on_epoch_end", lambda orig: _before(orig, lambda: _epoch_sync(trainer, cb)))
    wrap(conn, "update_eval_epoch_metrics", lambda orig: _before(orig, lambda: _epoch_sync(trainer, cb)))
    wrap(pl_module, "on_train_epoch_end", lambda orig: _after(orig, lambda: _epoch_sync(trainer, cb)))
    if cb.exact_eval:
        wrap(
            trainer._data_connector,
            "_prepare_dataloader",
            lambda orig: _wrapped_prepare(orig, trainer._data_connector, trainer),
        )
    return lambda: [u() for u in reversed(undo)] and None


def _before(orig: Callable, first: Callable[[], Any]) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        first()
        return orig(*args, **kwargs)

    return run


def _after(orig: Callable, then: Callable[[], Any]) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        then()
        return out

    return run


def _epoch_sync(trainer: L.Trainer, cb: _SyncHooks) -> None:
    """Once per epoch end: the first of the epoch-end sync points that is reached syncs."""
    if trainer.sanity_checking or cb._epoch_synced:
        return
    cb._sync(trainer, ("epoch",))
    cb._epoch_synced = True


def _wrapped_log(orig: Callable, results: Any, cb: _SyncHooks) -> Callable:
    def log(fx: str, name: str, value: Any, **kwargs: Any) -> None:
        kwargs.update(sync_dist=True, sync_dist_fn=_no_sync, sync_dist_group=None)
        orig(fx, name, value, **kwargs)
        key = f"{fx}.{name}"
        if kwargs.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
            key += f".{results.dataloader_idx}"
        cb._record(results, key, value, kwargs.get("batch_size"))

    return log


def _wrapped_metrics(orig: Callable, results: Any, cb: _SyncHooks) -> Callable:
    def metrics(on_step: bool) -> Any:
        out = orig(on_step)
        cb._overlay(results, on_step, out)
        return out

    return metrics


def _wrapped_reset(orig: Callable, results: Any, cb: _SyncHooks) -> Callable:
    def reset(metrics: bool | None = None, fx: str | None = None) -> None:
        orig(metrics, fx)
        cb._forget(results, metrics, fx)

    return reset


def _wrapped_prepare(orig: Callable, connector: Any, trainer: L.Trainer) -> Callable:
    def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
        if (
            mode in (RunningStage.VALIDATING, RunningStage.TESTING)
            and isinstance(dataloader, DataLoader)
            and connector._requires_distributed_sampler(dataloader)
        ):
            if isinstance(dataloader.sampler, SequentialSampler):
                from lightning.pytorch.utilities.data import _update_dataloader

                kwargs = trainer.distributed_sampler_kwargs or {}
                sampler = EvalDistributedSampler(
                    dataloader.dataset, kwargs.get("num_replicas"), kwargs.get("rank")
                )
                return _update_dataloader(dataloader, sampler, mode=mode)
            name = type(dataloader.sampler).__name__
            rank_zero_warn(
                f"AllReducedMetrics: the {mode.value} loader has a {name}, so Lightning's padding"
                " DistributedSampler may count some samples twice"
            )
        return orig(dataloader, shuffle, mode)

    return prepare
