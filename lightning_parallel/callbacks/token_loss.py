"""TokenWeightedLoss: each optimizer step's loss is the mean over its labelled tokens, as on one device.

Lightning averages the losses of an accumulation window's batches (and DDP the replicas' gradients)
equally; with padded, partly labelled batches (``ignore_index=-100``) that is not the mean over the
step's tokens that one device computes on the whole global batch (Lightning issue #20350). This
callback weights each batch by its items, as ``count(batch)`` counts them, with the mechanics of
:mod:`lightning_parallel.grads.item_weights`: the gradient of each batch's loss is scaled by its
items over a reference count (the loss's value is left as it is, for the progress bar and logs), and
once per optimizer step the gradients are scaled to the token mean over every replica. Under
:class:`~lightning_parallel.PipelineStrategy` it hands ``count`` to the strategy, which weights each
micro-batch the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel._picklable import HoldsUserCallables
from lightning_parallel.callbacks._step_wrapping import wrap_training_step
from lightning_parallel.grads.item_weights import ItemCount, ItemWindow, scale_gradients
from lightning_parallel.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["TokenWeightedLoss"]


class TokenWeightedLoss(HoldsUserCallables, Callback):
    """Make every optimizer step's loss the mean over all its items (labelled tokens), across micro-batches,
    accumulated batches and data-parallel replicas: what one device computes on the whole global batch.

    Your ``training_step`` returns the mean loss over a batch's items, as ``F.cross_entropy(...,
    ignore_index=-100)`` does; ``count(batch)`` says how many items that mean is over. Works with any
    strategy (one device, DDP, FSDP, PipelineStrategy) and with ``accumulate_grad_batches`` or
    :class:`~lightning_parallel.GradientAccumulationScheduler` (whose sample weighting it replaces).
    Values you log keep Lightning's weighting across batches; the loss Lightning shows and passes to
    ``on_train_batch_end`` is the batch's own mean.

    A Hugging Face model whose loss the step takes from ``labels=`` needs no callback under
    ``PipelineStrategy`` (its tokens are counted as its loss counts them); on other strategies give
    ``count=labelled_tokens("labels", shift=True)``.

    Args:
        count: ``count(batch) -> int | Tensor``, the items of a batch (under a pipeline: of a
            micro-batch, split as the batch is); e.g. ``labelled_tokens("labels")``. Under a spawn
            launch (``strategy="ddp_spawn"``, ``start_method="spawn"``) it is pickled for the ranks:
            a function of your own is then defined at the top level of a module, not a lambda.

    Raises:
        TypeError: ``count`` is not callable.
        pickle.PicklingError: when the callback is pickled (a spawn launch, before any rank starts),
            ``count`` cannot be; the message names it and the fix.
        RuntimeError: at setup, manual optimization or DeepSpeed (which owns backward and the gradients).

    Example::

        from lightning_parallel import TokenWeightedLoss, labelled_tokens

        # batches {"input_ids", "attention_mask", "labels"}; prompts and padding labelled -100
        trainer = L.Trainer(devices=4, strategy="ddp", accumulate_grad_batches=8,
                            callbacks=[TokenWeightedLoss(count=labelled_tokens("labels"))])
    """

    @checks_options
    def __init__(self, count: ItemCount) -> None:
        super().__init__()
        if not callable(count):
            raise TypeError(
                f"TokenWeightedLoss(count=...) takes a function of a batch, got {type(count).__name__}: "
                "e.g. count=labelled_tokens('labels'), or a function of your own defined at the top "
                "level of a module: def count(batch): return (batch[1] != -100).sum()"
            )
        self.count = count
        self.window = ItemWindow()
        self._weight = 1.0
        self._delegated = False
        self._restore: Callable[[], None] | None = None

    def _user_callables(self) -> dict[str, Any]:
        return {"TokenWeightedLoss(count={})": self.count}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "TokenWeightedLoss needs automatic optimization: with manual optimization you own backward; "
                "divide each loss's sum by the step's items yourself"
            )
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            raise RuntimeError("TokenWeightedLoss does not support DeepSpeed, which owns the gradients")
        self._delegated = isinstance(trainer.strategy, PipelineStrategy)
        if self._delegated:  # it weights each micro-batch itself
            trainer.strategy.weight_items_by(self.count)
            return
        self._restore = _scale_loss_gradient(pl_module, lambda: self._weight)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._delegated:
            return
        items = float(torch.as_tensor(self.count(batch), dtype=torch.float64))
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        reference = self.window.add_batch(items, group, copies=_replicas(trainer)[1])
        # Lightning divides the loss by accumulate_grad_batches before backward: undone here.
        self._weight = items / reference * trainer.accumulate_grad_batches

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._delegated:  # after the replicas' reduction and before clipping
            scale_gradients(pl_module.parameters(), self.window.gradient_factor(_replicas(trainer)[0]))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
        self.window = ItemWindow()


def _replicas(trainer: pl.Trainer) -> tuple[int, int]:
    """(data-parallel replicas, ranks per replica): ``num_replicas`` of the sampler, of the world."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    replicas = int(kwargs.get("num_replicas", 1))
    return replicas, max(1, trainer.world_size // replicas)


def _scale_loss_gradient(pl_module: pl.LightningModule, weight: Callable[[], float]) -> Callable[[], None]:
    """Wrap ``pl_module.training_step`` on the instance so the gradient of its loss is ``weight()`` times
    larger (a hook on the loss: its value is unchanged); returns the undo function."""

    def hooked(output: Any) -> Any:
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if torch.is_tensor(loss) and loss.requires_grad:
            factor = weight()
            loss.register_hook(lambda grad: grad * factor)
        return output

    return wrap_training_step(pl_module, hooked)
