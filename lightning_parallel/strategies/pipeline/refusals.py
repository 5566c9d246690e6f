"""What PipelineStrategy refuses before any rank trains, each with the reason and the fix."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def refuse_compiled_module(module: Any) -> None:
    """A LightningModule compiled by ``torch.compile(model)``: refused, with the one-line fix.

    Lightning unwraps the ``OptimizedModule`` and sets the compiled ``forward`` and step methods on the
    module itself, which cannot be pickled for spawned workers and would compile the user's step around
    the pipeline; the stages are compiled by the strategy instead, after the split.
    """
    if getattr(module, "_compiler_ctx", None) is not None:
        raise ValueError(
            f"{type(module).__name__} was compiled with torch.compile(model); PipelineStrategy splits the "
            f"module first and compiles each stage's blocks itself: pass the module uncompiled and use "
            f"PipelineStrategy(compile=True) (or compile={{...torch.compile's options}})"
        )


def check_fit_supported(trainer: pl.Trainer) -> None:
    if not trainer.lightning_module.automatic_optimization:
        raise ValueError(
            "PipelineStrategy supports automatic optimization only (it runs forward and backward inside "
            f"its schedule), and {type(trainer.lightning_module).__name__} sets "
            "`self.automatic_optimization = False`: remove that line"
        )


def refuse_unsupported_callbacks(trainer: pl.Trainer) -> None:
    """Refuse, on every rank before any process group work, the callbacks that cannot run on split stages."""
    from lightning.pytorch.callbacks import BatchSizeFinder, StochasticWeightAveraging, WeightAveraging

    for callback in trainer.callbacks:
        name = type(callback).__name__
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            raise ValueError(
                f"{name} is not supported under PipelineStrategy: it averages a copy of the whole module "
                f"taken before the strategy splits it into stages, and a checkpoint keeps the copy of "
                f"global rank 0 only. Train without it and average the weights offline: the consolidated "
                f"checkpoints of the last epochs (consolidate_checkpoint for distributed ones)"
            )
        if isinstance(callback, BatchSizeFinder):
            raise ValueError(
                f"{name} is not supported under PipelineStrategy (Lightning tunes the batch size on one "
                f"device only): find it with Tuner(L.Trainer(devices=1)).scale_batch_size(model), then "
                f"give each data-parallel replica that batch size (a multiple of num_microbatches)"
            )


def refuse_disk_beside_auto(plan: Any, offload_to: str) -> None:
    """``offload_to="disk"`` is a choice ``plan="auto"`` makes itself: one message with the fix, before the
    plan's own checks (which, with ``offload_dir`` taken for the search, would name another problem).

    Raises:
        ValueError: both are given.
    """
    if plan == "auto" and offload_to == "disk":
        raise ValueError(
            "plan='auto' chooses where the optimizer state goes, but offload_to='disk' was given: drop "
            "offload_to and keep offload_dir= (the search offers the disk tier there, and takes it only "
            "where the host memory cannot hold the state), or choose the plan yourself (no plan='auto') with "
            "offload='optimizer', offload_to='disk', offload_dir=..."
        )
