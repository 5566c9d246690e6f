"""GradientAccumulationScheduler: a fixed (or ramped) global batch, exact at any device count.

Loss-weighting protocol (what other strategies can rely on):

* Lightning divides the value returned by ``training_step`` by ``trainer.accumulate_grad_batches``
  before backward. This callback sets ``trainer.accumulate_grad_batches`` to the nominal factor of the
  current accumulation window and, in ``on_train_batch_start``, a multiplier ``m_i = factor x n_i /
  N_window`` (``n_i`` samples in batch ``i`` on this rank, ``N_window`` samples in this rank's window).
* It wraps ``pl_module.training_step`` on the instance (so every caller sees it, including a strategy that
  calls it once per micro-batch) and multiplies the returned loss (the tensor, or ``"loss"`` of a dict) by
  ``m_i``; the same ``m_i`` for every call within one batch. The backward losses of a window then add up
  to ``sum n_i*loss_i / N_window``: the mean over the samples the step saw, also for the epoch's last, short
  window and a short last batch. A strategy that splits a batch into micro-batches weights each by
  ``n_mb / n_batch`` and divides by ``trainer.accumulate_grad_batches`` read at the step; that composes.
* DDP averages over replicas, which is the global sample mean because every replica has the same sample
  count per window (checked once at train start).

Window boundaries follow Lightning (``batch_idx % accumulate_grad_batches``) whenever the factor is fixed
within an epoch; only a ``global_batch_size`` ramp keyed by optimizer step needs the override in
:func:`~lightning_parallel.callbacks._accumulation_internals._override_window_boundaries`.
"""

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.callbacks._accumulation_checks import (
    check_scheduling,
    check_supported,
    warn_if_optimizer_hooks_overridden,
)
from lightning_parallel.callbacks._accumulation_internals import (
    _install_loss_multiplier,
    _install_stepping_estimate,
    _override_window_boundaries,
    _set_train_progress_total,
)
from lightning_parallel.callbacks.token_loss import TokenWeightedLoss
from lightning_parallel.data.accumulation_plan import (
    AccumulationPlan,
    Window,
    check_equal_across_replicas,
    epoch_batch_sizes,
    loss_multiplier,
    next_window,
    plan_from_factors,
    plan_from_global_batch,
    validate_schedule,
)
from lightning_parallel.data.batch_samples import samples_in
from lightning_parallel.data.step_count import batches_until_step, count_optimizer_steps
from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.distributed.collectives import all_gather_objects

__all__ = ["GradientAccumulationScheduler"]


class GradientAccumulationScheduler(Callback):
    """Accumulate gradients so every optimizer step sees a given global batch, with the exact sample mean.

    Give either ``scheduling`` (Lightning's ``{epoch: factor}``, meaning what it means in
    ``lightning.pytorch.callbacks.GradientAccumulationScheduler``) or ``global_batch_size`` (an int, or
    ``{optimizer step: size}`` for a warm-up ramp). With ``global_batch_size`` the factor is
    ``global_batch_size / (per-device batch x data-parallel replicas)``, read from the real train
    dataloader and the strategy's ``distributed_sampler_kwargs["num_replicas"]`` when training starts.
    A factor change takes effect at the next window boundary. ``global_batch_size`` and
    ``accumulate_grad_batches`` are logged (rank 0) whenever they change.

    Args:
        scheduling: ``{epoch: factor}``; epochs before the first key accumulate 1 batch.
        global_batch_size: samples per optimizer step over all replicas; an int or ``{step: size}``
            (the ramp must give step 0).

    Raises:
        MisconfigurationException: (also a ValueError) a ``scheduling`` key that is not an int >= 0
            or a factor that is not an int >= 1, with Lightning's messages (here).
        TypeError: an empty ``scheduling`` (as Lightning), non-int ``global_batch_size`` keys or values,
            or both / neither argument given (here); at train start, a train dataloader that is not
            one ``torch.utils.data.DataLoader``.
        ValueError: non-positive ``global_batch_size`` values, negative or non-increasing keys (here);
            at ``setup`` or train start: ``Trainer(accumulate_grad_batches>1)``, a global batch that the
            loader cannot give exactly (with the nearest valid choices), a loader without a fixed batch
            size or a length.
        RuntimeError: at ``setup`` or train start, manual optimization or a strategy that accumulates
            by itself (DeepSpeed), with Lightning's messages.

    Warns, as Lightning's callback does, when the module overrides ``optimizer_step`` or
    ``optimizer_zero_grad`` and the schedule accumulates: they run once per optimizer step.

    Note:
        Manual optimization is refused: there the user owns backward and step, so weight each loss by
        its samples over the window's samples and step at the window's end by hand. The loss Lightning
        passes to ``on_train_batch_end`` is the batch's weighted share (it sums over a window to the
        rank's mean for that step); values logged with ``self.log`` in ``training_step`` are unscaled.
        ``trainer.estimated_stepping_batches`` counts the optimizer steps of this plan, ramps included
        (read in ``configure_optimizers`` it loads the train dataloader, as Lightning's does), so
        ``OneCycleLR(total_steps=trainer.estimated_stepping_batches)`` ends with the run. With
        ``Trainer(max_steps=...)`` the progress bar counts the batches those steps take.

    Example::

        from lightning_parallel import GradientAccumulationScheduler

        # 256 samples per optimizer step, whatever the device count and per-device batch
        trainer = L.Trainer(devices=4, callbacks=[GradientAccumulationScheduler(global_batch_size=256)])
        # warm-up: 64 samples per step for the first 1000 optimizer steps, then 256
        GradientAccumulationScheduler(global_batch_size={0: 64, 1000: 256})
        # Lightning's form
        GradientAccumulationScheduler(scheduling={0: 8, 4: 4})
    """

    @checks_options
    def __init__(
        self,
        scheduling: Mapping[int, int] | None = None,
        *,
        global_batch_size: int | Mapping[int, int] | None = None,
    ) -> None:
        super().__init__()
        if (scheduling is None) == (global_batch_size is None):
            raise TypeError(
                "give exactly one of scheduling={epoch: factor} or global_batch_size=int | {step: size}, "
                f"got scheduling={scheduling!r}, global_batch_size={global_batch_size!r}"
            )
        if scheduling is not None:
            if not isinstance(scheduling, Mapping):
                raise TypeError(
                    f"scheduling must be a dict {{epoch: factor}}, got {type(scheduling).__name__}"
                )
            scheduling = check_scheduling(scheduling)
            self.scheduling: dict[int, int] | None = validate_schedule(scheduling, "scheduling", "epoch")
            self.global_batch_size: dict[int, int] | None = None
        else:
            self.scheduling = None
            self.global_batch_size = validate_schedule(
                global_batch_size, "global_batch_size", "optimizer step"
            )
            plan_from_global_batch(self.global_batch_size, 1, 1)  # checks the ramp starts at step 0
        self.plan: AccumulationPlan | None = None
        self._batch_sizes: tuple[int, ...] = ()
        self._window: Window | None = None
        self._multiplier = 1.0
        self._logged: tuple[int, int] | None = None
        self._restore: list[Callable[[], None]] = []
        self._warned = False
        self._progress_total_due = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_supported(trainer, pl_module)
        self._restore.append(
            _install_stepping_estimate(trainer, lambda lightning: self._stepping_batches(trainer, lightning))
        )

    def _stepping_batches(self, trainer: pl.Trainer, lightning: Callable[[], int | float]) -> int | float:
        """``trainer.estimated_stepping_batches`` under this plan (Lightning's where no factor matters)."""
        if trainer.max_epochs == -1:
            return lightning()
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # what Lightning's estimate does
        if trainer.train_dataloader is None or trainer.num_training_batches == float("inf"):
            return lightning()
        plan = self._make_plan(_loader_layout(trainer.train_dataloader)[0], trainer)
        epochs = max(trainer.max_epochs or 1, 1)
        return count_optimizer_steps(plan, int(trainer.num_training_batches), epochs, trainer.max_steps)

    def _make_plan(self, per_device: int, trainer: pl.Trainer) -> AccumulationPlan:
        replicas = _data_parallel_size(trainer.strategy)
        if self.global_batch_size is not None:
            return plan_from_global_batch(self.global_batch_size, per_device, replicas)
        return plan_from_factors(self.scheduling, per_device, replicas)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_supported(trainer, pl_module)  # Lightning's callback checks here (setup checked already)
        if trainer.train_dataloader is not None:  # None only when called outside a fit
            self._start_plan(trainer, pl_module)
        factors = (
            [p.factor for p in self.plan.phases] if self.plan else list((self.scheduling or {}).values())
        )
        warn_if_optimizer_hooks_overridden(pl_module, any(f > 1 for f in factors))

    def _start_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plan = self._make_plan(self._agreed_layout(trainer), trainer)
        rank_zero_info(f"GradientAccumulationScheduler plan:\n{self.plan.format_table()}")
        self._restore.append(_install_loss_multiplier(pl_module, lambda: self._multiplier))
        if self.plan.changes_mid_epoch:
            self._restore.append(
                _override_window_boundaries(trainer, self._is_window_end, self._is_window_start)
            )

    def _agreed_layout(self, trainer: pl.Trainer) -> int:
        """This rank's per-device batch size, once every rank's loader layout is gathered and agrees.

        A rank that cannot read its loader makes every rank raise its error before the gather.
        """
        with failing_together():
            per_device, num_samples, drop_last = _loader_layout(trainer.train_dataloader)
        layout = [per_device, num_samples, int(drop_last), _num_batches(trainer)]
        # (Lightning's strategy.all_gather goes through torch.distributed.nn, deprecated in torch 2.13)
        rows = all_gather_objects(layout)
        check_equal_across_replicas(rows, ["batch_size", "samples", "drop_last", "batches"])
        return per_device

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        per_device, num_samples, drop_last = _loader_layout(trainer.train_dataloader)
        self._batch_sizes = epoch_batch_sizes(num_samples, per_device, _num_batches(trainer), drop_last)
        self._window = None
        self._progress_total_due = True  # the progress bar sets its total after this hook
        if self.plan is not None and self.plan.unit == "epoch":
            # Lightning's own callback sets the factor here; keep that for code reading it at epoch start.
            trainer.accumulate_grad_batches = self.plan.factor_at(trainer.current_epoch)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._progress_total_due:
            self._progress_total_due = False
            self._fix_progress_total(trainer)
        if self._window is None or batch_idx not in self._window:
            self._start_window(trainer, batch_idx)
        window = self._window
        expected = self._batch_sizes[batch_idx] if batch_idx < len(self._batch_sizes) else None
        actual = samples_in(batch)
        if actual is not None and actual != expected and not self._warned:
            self._warned = True
            warnings.warn(
                f"batch {batch_idx} has {actual} samples where the loader's layout says {expected}: "
                "this step's mean is weighted by the layout, not the batch",
                stacklevel=2,
            )
        n_i = expected if expected is not None else (actual or 0)
        # Item-weighted losses (TokenWeightedLoss, or a pipelined Hugging Face loss from labels=) weight
        # each batch by its items, which subsumes this sample weighting: it must not apply on top.
        weighted = _weights_items(trainer)
        self._multiplier = 1.0 if weighted else loss_multiplier(window, n_i, trainer.accumulate_grad_batches)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._multiplier = 1.0

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        while self._restore:
            self._restore.pop()()
        # Back to the value setup required, so a second fit with this Trainer passes that check again.
        trainer.accumulate_grad_batches = 1
        self._window = None
        self._multiplier = 1.0

    def _fix_progress_total(self, trainer: pl.Trainer) -> None:
        # Lightning's bar counts one batch per step up to max_steps when max_epochs=-1.
        if trainer.max_epochs != -1 or trainer.max_steps <= 0 or self.plan is None:
            return
        total = batches_until_step(
            self.plan, len(self._batch_sizes), trainer.current_epoch, trainer.global_step, trainer.max_steps
        )
        _set_train_progress_total(trainer, total)

    def _start_window(self, trainer: pl.Trainer, batch_idx: int) -> None:
        index = trainer.global_step if self.plan.unit == "step" else trainer.current_epoch
        phase = self.plan.phase_at(index)
        self._window = next_window(batch_idx, phase.factor, self._batch_sizes)
        trainer.accumulate_grad_batches = phase.factor
        if self._logged != (phase.global_batch_size, phase.factor):
            self._logged = (phase.global_batch_size, phase.factor)
            self._log_change(trainer, phase.global_batch_size, phase.factor)

    def _log_change(self, trainer: pl.Trainer, global_batch_size: int, factor: int) -> None:
        rank_zero_info(
            f"step {trainer.global_step}: global_batch_size={global_batch_size}, "
            f"accumulate_grad_batches={factor}"
        )
        if trainer.is_global_zero:
            metrics = {
                "global_batch_size": float(global_batch_size),
                "accumulate_grad_batches": float(factor),
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _is_window_end(self, batch_idx: int) -> bool | None:
        if self._window is None or batch_idx not in self._window:
            return None
        return batch_idx == self._window.stop - 1

    def _is_window_start(self, batch_idx: int) -> bool | None:
        if self._window is None or batch_idx not in self._window:
            return None
        return batch_idx == self._window.start


def _weights_items(trainer: pl.Trainer) -> bool:
    """Whether the training loss is item-weighted: a TokenWeightedLoss, or the strategy's own counting."""
    return getattr(trainer.strategy, "weights_items", False) or any(
        isinstance(c, TokenWeightedLoss) for c in trainer.callbacks
    )


def _data_parallel_size(strategy: pl.strategies.Strategy) -> int:
    """Replicas that split each batch: ``num_replicas`` of the sampler kwargs (not the world size), else 1."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    return int(kwargs.get("num_replicas", 1)) if kwargs else 1


def _num_batches(trainer: pl.Trainer) -> int:
    num = trainer.num_training_batches
    if num == float("inf"):
        raise ValueError(
            "GradientAccumulationScheduler needs a train dataloader with a length (the epoch's last window "
            "must be known to weight it exactly): give the dataset a __len__ or set limit_train_batches"
        )
    return int(num)


def _loader_layout(loader: Any) -> tuple[int, int, bool]:
    """(per-device batch size, samples per epoch on this rank, drop_last) of the real train dataloader."""
    if not isinstance(loader, DataLoader):
        raise TypeError(
            "GradientAccumulationScheduler needs one torch DataLoader for training, got "
            f"{type(loader).__name__}: "
            "combine several loaders into one dataset"
        )
    batch_sampler = loader.batch_sampler
    batch_size = (
        loader.batch_size if loader.batch_size is not None else getattr(batch_sampler, "batch_size", None)
    )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"the train dataloader has no fixed batch size (batch_size={batch_size!r}): use "
            "DataLoader(batch_size=...) or a batch_sampler with an int .batch_size"
        )
    sampler = getattr(batch_sampler, "sampler", None) or loader.sampler
    try:
        num_samples = len(sampler)
    except TypeError:
        raise ValueError(
            f"the train dataloader's sampler ({type(sampler).__name__}) has no length: exact accumulation "
            "needs to know each batch's samples ahead; use a map-style dataset"
        ) from None
    return batch_size, num_samples, bool(getattr(batch_sampler, "drop_last", loader.drop_last))
