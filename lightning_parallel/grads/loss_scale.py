"""One loss scale for the whole pipeline: every stage and replica skips an overflowing step, or none does.

Under fp16 a ``torch.amp.GradScaler`` checks the gradients for inf/NaN when it unscales them and skips
``optimizer.step()`` if it found one. A pipeline rank holds one stage's gradients only: left alone, the
stage that overflowed would skip while the others step, the replicas of a tied weight would diverge,
and the scales would drift apart. Here ``found_inf`` is reduced (MAX) over the ranks right after
``unscale_``, before ``step`` and ``update`` read it, so every rank decides alike and keeps the same
scale (Megatron all-reduces ``found_inf`` over its model-parallel group the same way). Pure PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.distributed.tensors import all_reduce_coalesced

__all__ = ["agree_found_inf", "agree_on_overflow"]


def agree_on_overflow(scaler: torch.amp.GradScaler, group: Any | None = None) -> None:
    """Make every ``scaler.unscale_(optimizer)`` end with :func:`agree_found_inf` over ``group``.

    ``unscale_`` runs on every rank at the same point of the step (Lightning calls it before clipping,
    or ``scaler.step`` calls it), so the one all-reduce it adds is matched on every rank. The scaler
    object stays the user's (an instance attribute wraps the method); installing again replaces the
    previous wrapper. A disabled scaler never skips a step and is left as it is.

    Example::

        agree_on_overflow(scaler)                    # on every rank, once
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                   # found_inf is now the world's
        scaler.step(optimizer); scaler.update()      # every rank skips, or every rank steps
    """
    if not scaler.is_enabled():
        return
    unscale = getattr(scaler.unscale_, "__wrapped__", scaler.unscale_)

    def unscale_and_agree(optimizer: torch.optim.Optimizer) -> None:
        with _local_gradients(optimizer):
            unscale(optimizer)
        agree_found_inf(scaler, optimizer, group)

    unscale_and_agree.__wrapped__ = unscale  # type: ignore[attr-defined]
    scaler.unscale_ = unscale_and_agree  # type: ignore[method-assign]


@contextlib.contextmanager
def _local_gradients(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While ``unscale_`` runs: the optimizer's DTensor gradients (FSDP2, tensor parallelism) seen as
    their local shards.

    GradScaler checks and unscales each device's gradients in one op; DTensor's rule for it takes only
    lists of DTensors, while a tensor-parallel stage holds DTensor (split) and plain (whole) gradients
    side by side. GradScaler reads
    nothing but ``param.grad`` of each parameter, so for the call each DTensor-gradient parameter is
    stood in for by a plain alias of its local gradient shard whose ``grad`` is that shard (no copy:
    the unscale writes through). ``found_inf`` is then this rank's; :func:`agree_found_inf` makes it the
    world's right after.
    """
    saved = [group["params"] for group in optimizer.param_groups]
    if not any(isinstance(p.grad, DTensor) for params in saved for p in params):
        yield
        return
    with torch.no_grad():
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = [_local_stand_in(p.grad) if isinstance(p.grad, DTensor) else p for p in params]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


def _local_stand_in(grad: DTensor) -> torch.Tensor:
    local = grad.to_local()
    stand_in = local.detach()
    stand_in.grad = local
    return stand_in


def agree_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, group: Any | None = None
) -> bool:
    """Set this optimizer's ``found_inf`` to its maximum over ``group``; return whether any rank found one.

    Call it on every rank of ``group`` after ``scaler.unscale_(optimizer)`` and before ``scaler.step``.
    A rank whose optimizer had no gradient at all gets an entry too, so ``step`` and ``update`` work.
    """
    per_device = _found_inf_per_device(scaler, optimizer)
    device = scaler._scale.device if scaler._scale is not None else torch.device("cpu")
    local = torch.zeros(1, dtype=torch.float32, device=device)
    for found in per_device.values():
        local += found.to(device)
    all_reduce_coalesced([local], group, op="max")
    agreed = (local > 0).to(torch.float32)
    if not per_device:
        per_device[device] = agreed.reshape(())
    for found in per_device.values():
        found.copy_(agreed.reshape(()))
    return bool(agreed.item())


def _found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict:
    """The scaler's per-device ``found_inf`` tensors for ``optimizer``: private GradScaler state.

    Checked against torch 2.13 (``GradScaler._per_optimizer_states[id(optimizer)]
    ["found_inf_per_device"]``, filled by ``unscale_``, read by ``step`` and ``update``; and
    ``GradScaler._scale``, whose device a new entry takes); ``tests/test_loss_scale.py`` fails if
    either moves.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get("found_inf_per_device"), dict):
        raise RuntimeError(
            f"torch {torch.__version__}'s GradScaler no longer keeps found_inf_per_device in "
            "_per_optimizer_states after unscale_ (checked against torch 2.13): the pipeline cannot agree "
            "on skipped fp16 steps; use precision='bf16-mixed', or update grads/loss_scale.py"
        )
    return state["found_inf_per_device"]
