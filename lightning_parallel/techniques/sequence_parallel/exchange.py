"""The exchanges of a sequence-parallel group: tokens for heads (all-to-all, with autograd) and back.

A rank of a group of ``k`` holds ``t`` consecutive tokens of every sample (its shard, shard ``i`` holds
tokens ``i*t .. (i+1)*t - 1``). :func:`tokens_to_heads` turns its ``(b, heads, t, d)`` attention input
("my tokens, all heads") into ``(b, heads/k, k*t, d)`` ("all tokens, my heads": heads
``i*heads/k ..``), the whole sequence in token order; :func:`heads_to_tokens` is its inverse, and each
is the other's backward. One ``all_to_all_single`` each way, one copy into its send buffer and one out
of its receive buffer (DeepSpeed's ``_SeqAllToAll``, Megatron's ``cp_comm_type="a2a"``).

A rank may put a number beside its data (``flag``): every rank gets every rank's number from the same
all-to-all, so a decision one rank made about its shard (an attention mask it cannot take) reaches the
group without a collective of its own, and every rank acts on it at the same point.

:func:`gather_tokens` puts the shards of a tensor back in token order (evaluation outputs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_tokens", "heads_to_tokens", "tokens_to_heads"]


def tokens_to_heads(
    x: torch.Tensor, group: Any, flag: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(b, heads, t, d)`` of this rank's tokens -> ``(b, heads/k, k*t, d)`` of every token, its heads.

    Args:
        x: this rank's shard of an attention input (query, key or value), heads on dim 1, tokens on 2.
        group: the sequence-parallel process group (``k`` ranks, in shard order).
        flag: a number this rank sends beside its data (``None``: none).

    Returns:
        The exchanged tensor, and with ``flag`` the ``k`` ranks' flags (a float tensor, by rank).
        Differentiable in ``x``: its backward is :func:`heads_to_tokens` of the gradient.

    Example::

        q_all_tokens, flags = tokens_to_heads(q, group, flag=0.0)   # (b, h/k, T, d), (k,)
    """
    out, flags = _Exchange.apply(x, group, True, flag)
    return out, (flags if flag is not None else None)


def heads_to_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``(b, heads/k, k*t, d)`` of every token -> ``(b, heads, t, d)`` of this rank's tokens, all heads.

    The inverse of :func:`tokens_to_heads`; its backward is :func:`tokens_to_heads` of the gradient.

    Example::

        out = heads_to_tokens(attention_over_all_tokens, group)   # (b, h, t, d)
    """
    return _Exchange.apply(x, group, False, None)[0]


def gather_tokens(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Every rank's shard of ``x`` (its tokens on ``dim``) concatenated in token order (no autograd).

    What an evaluation output (logits, predictions) of a sequence-parallel group is on one device.

    Example::

        logits = gather_tokens(local_logits, group)   # (b, T, vocab) on every rank of the group
    """
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _send_buffer(x: torch.Tensor, k: int, to_heads: bool, flag: float | None) -> torch.Tensor:
    """``x`` laid out as ``k`` rows, row ``j`` what rank ``j`` gets (one copy), a flag column if any."""
    b, h, t, d = x.shape
    if to_heads:  # row j: heads j*h/k.. of my tokens
        rows = x.view(b, k, h // k, t, d).transpose(0, 1)
    else:  # row j: my heads of rank j's tokens
        rows = x.view(b, h, k, t // k, d).permute(2, 0, 1, 3, 4)
    width = rows[0].numel()
    buffer = x.new_empty(k, width + (flag is not None))
    buffer[:, :width].view(rows.shape).copy_(rows)
    if flag is not None:
        buffer[:, width] = flag
    return buffer


def _from_receive_buffer(
    received: torch.Tensor, shape: torch.Size, k: int, to_heads: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exchanged tensor (one copy) and the flag column (empty without flags) of a receive buffer."""
    b, h, t, d = shape
    if to_heads:  # row j: my heads of rank j's tokens, in token order once concatenated
        width = b * (h // k) * t * d
        rows = received[:, :width].view(k, b, h // k, t, d)
        out = rows.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * t, d)
    else:  # row j: heads j*h/k.. of my tokens
        width = b * h * (t // k) * d
        rows = received[:, :width].view(k, b, h, t // k, d)
        out = rows.transpose(0, 1).reshape(b, k * h, t // k, d)
    return out, received[:, width:].reshape(-1).float()


def _all_to_all(
    x: torch.Tensor, group: Any, to_heads: bool, flag: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    k = dist.get_world_size(group)
    send = _send_buffer(x, k, to_heads, flag)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return _from_receive_buffer(received, x.shape, k, to_heads)


class _Exchange(torch.autograd.Function):
    """One all-to-all between the token and the head layouts; backward is the opposite one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool, flag: float | None) -> Any:
        ctx.group, ctx.to_heads = group, to_heads
        out, flags = _all_to_all(x, group, to_heads, flag)
        ctx.mark_non_differentiable(flags)
        return out, flags

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _flags: Any) -> Any:
        back, _ = _all_to_all(grad.contiguous(), ctx.group, not ctx.to_heads, None)
        return back, None, None, None
