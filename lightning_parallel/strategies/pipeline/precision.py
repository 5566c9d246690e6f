"""The precision plugin under PipelineStrategy: fp16 loss scaling agreed by every rank, clipping by the
global norm.

Clipping: Lightning's ``Precision.clip_grad_by_norm`` clips by this rank's norm only; a stage holds a
slice of the model, so the norm is reduced over the pipeline (:func:`install_global_clipping`).

fp16 loss scaling: Lightning's own MixedPrecision plugin and GradScaler.

Lightning scales the loss in ``pre_backward`` and runs ``loss.backward()`` itself; under the pipeline the
backward runs inside the schedule, on the last stage's per-micro-batch losses, so the scale is applied
there (:func:`scaled_loss`). Everything after backward is Lightning's: ``unscale_`` before clipping,
``scaler.step`` skipping on inf, ``scaler.update`` growing or backing off. What the pipeline adds is the
agreement (:func:`~lightning_parallel.grads.loss_scale.agree_on_overflow`): found_inf is the world's
before any rank steps, so every stage and replica skips together and the scale is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_parallel.grads.loss_scale import agree_on_overflow
from lightning_parallel.grads.reduce import clip_grad_norm_across
from lightning_parallel.grads.tied import SharedReplicas


def loss_scaler(plugin: Precision) -> torch.amp.GradScaler | None:
    """The precision plugin's GradScaler (``16-mixed``), or None (``MixedPrecision.scaler``, public)."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def scaled_loss(plugin: Precision, loss: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as the schedule's backward must see it: times the loss scale under fp16."""
    scaler = loss_scaler(plugin)
    return loss if scaler is None else scaler.scale(loss)


def install_loss_scaling(plugin: Precision, optimizers: Sequence[Any]) -> None:
    """Make the plugin's GradScaler agree on overflow over every rank (a no-op without a scaler).

    Raises:
        ValueError: an optimizer unscales inside its own ``step`` (``fused=True``), after the point
            where the ranks can agree.
    """
    scaler = loss_scaler(plugin)
    if scaler is None:
        return
    fused = [type(o).__name__ for o in optimizers if getattr(o, "_step_supports_amp_scaling", False)]
    if fused:
        raise ValueError(
            f"PipelineStrategy with precision='16-mixed' needs the GradScaler to unscale before the step, "
            f"but {', '.join(fused)} unscales inside its own step (fused=True), where the stages cannot "
            f"agree on a skipped step: build it with fused=False (foreach=True is as fast on most models)"
        )
    agree_on_overflow(scaler)


def install_global_clipping(plugin: Precision, pp_group: Any, shared: SharedReplicas) -> None:
    """Clip by the norm over every stage of the pipeline (a tied weight's replicas counted once).

    No public hook exists below ``configure_gradient_clipping``, hence this instance-level override of
    the plugin's ``clip_grad_by_norm`` (Lightning 2.6.6).
    """

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        params = plugin.main_params(optimizer)
        clip_grad_norm_across(params, float(clip_val), pp_group, not_counted=shared.not_counted)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
