"""Sequence parallelism for an eager forward, without editing the model: a ``TorchFunctionMode``.

While :func:`sequence_parallel` is entered, every ``F.scaled_dot_product_attention`` call (and the
``aten`` op behind it) runs as :func:`~.attention.ulysses_attention` over the group, and each integer
``arange(t)`` of the shard's length is offset to the shard's positions (:mod:`.positions`). Why a
function mode, not Hugging Face's ``AttentionInterface``: one mechanism serves the project's GPTs, any
model written with SDPA and Hugging Face decoders on their default ``sdpa`` path (Llama, Qwen2,
Mistral, GPT-NeoX, with grouped-query attention through ``enable_gqa`` or repeated key/value heads);
it needs no transformers import and no change to the model's config; and it finds the positions too,
which the attention interface does not see. Its limits: a model whose attention is not SDPA (Hugging
Face's ``eager`` or ``flash_attention_2`` implementations, a hand-written softmax) is not split, so
:meth:`SequenceParallelMode.check_found` refuses a forward that called no SDPA; and the mode costs a
Python call per torch function while it is on.

Two ways to turn it on. :func:`sequence_parallel` around a forward. :func:`run_forwards_in` for a
stage: the forward of the module and of each submodule enters the mode (the outermost call does), so
it is on wherever the model's code runs and nowhere else (not in a loss computed from the outputs),
and also when activation checkpointing recomputes a block in backward: autograd runs backward with no
function mode on (checked: a mode entered around ``backward()`` is not on in a checkpoint's
recomputation), so the recomputed forward must enter it itself. A unit recomputed whose own body calls
SDPA is covered when this wrapping comes before the recomputation's (which then recomputes the wrapped
forward); a unit whose SDPA sits in a submodule is covered in either order.

Example::

    mode = SequenceParallelMode(group, tokens=local_ids.shape[1])
    undo = run_forwards_in(mode, model)
    loss = F.cross_entropy(model(local_ids).flatten(0, 1), local_targets.flatten())
    mode.check_found("model")
    loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from lightning_parallel.techniques.sequence_parallel.attention import ulysses_attention
from lightning_parallel.techniques.sequence_parallel.positions import (
    arange_bounds,
    is_positions,
    offset_positions,
)

__all__ = ["SequenceParallelMode", "is_on", "run_forwards_in", "sequence_parallel"]

_ATTENTION = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_ARANGE = (
    torch.arange,
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.arange.start_step,
)


class SequenceParallelMode(TorchFunctionMode):
    """SDPA calls become Ulysses attention over ``group``; the shard's ``arange(tokens)`` its positions.

    Args:
        group: the sequence-parallel process group, its ranks in shard order.
        tokens: the tokens of this rank's shard (every rank of the group holds as many); set
            ``mode.tokens`` again when a batch of another length comes.
        positions: offset the shard's ``arange(tokens)`` (see :mod:`.positions`).

    Example::

        with SequenceParallelMode(group, tokens=4):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # over all 4*k tokens
    """

    def __init__(self, group: Any, tokens: int, positions: bool = True) -> None:
        super().__init__()
        self.group, self.tokens, self.positions = group, tokens, positions
        self.index = dist.get_rank(group)
        self.attention_calls = 0
        self.offsets = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ATTENTION:
            self.attention_calls += 1
            return ulysses_attention(*args, **kwargs, group=self.group)
        result = func(*args, **kwargs)
        positions = self.positions and func in _ARANGE and torch.is_tensor(result)
        if positions and is_positions(result, arange_bounds(args, kwargs), self.tokens):
            self.offsets += 1
            return offset_positions(result, self.index)
        return result

    def check_found(self, what: str) -> None:
        """Refuse a forward of ``what`` that called no SDPA: its attention ran on the shard alone.

        Every rank of the group runs the same model, so every rank raises here, at the same point.

        Raises:
            RuntimeError: naming what was looked for and how to make the model call it.
        """
        if self.attention_calls:
            return
        raise RuntimeError(
            f"sequence parallelism found no attention to split in {what}: it looks for calls of "
            "torch.nn.functional.scaled_dot_product_attention, and the forward made none, so its attention "
            "saw only this rank's shard of the sequence. A Hugging Face model: load it with "
            "attn_implementation='sdpa'; a model of yours: compute attention with "
            "F.scaled_dot_product_attention(q, k, v, is_causal=True) instead of softmax(q @ k^T)"
        )


def run_forwards_in(mode: SequenceParallelMode, module: nn.Module) -> Callable[[], None]:
    """Make the forward of ``module`` and of every submodule run in ``mode`` (entered by the outermost).

    Returns:
        A function that undoes it (each forward as it was).

    Example::

        undo = run_forwards_in(SequenceParallelMode(group, tokens=4), stage_module)
    """
    wrapped = []
    for sub in module.modules():
        own = vars(sub).get("forward")  # an instance's own forward (another technique's wrapper)
        sub.forward = _entering(mode, sub.forward)
        wrapped.append((sub, own))

    def undo() -> None:
        for sub, own in wrapped:
            if own is None:
                del sub.forward
            else:
                sub.forward = own

    return undo


def _entering(mode: SequenceParallelMode, forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if is_on(mode):  # (entered twice, it would split an attention twice)
            return forward(*args, **kwargs)
        with mode:
            return forward(*args, **kwargs)

    return run


def is_on(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on in this thread now.

    Asked of torch's stack, not counted: the autograd engine runs backward, and a checkpoint's
    recomputation in it, with no function mode on, whatever was entered around ``backward()``.
    torch 2.13 has no public way to ask (``_get_current_function_mode_stack`` is private; a test of
    test_sequence_parallel.py fails if it goes).
    """
    return any(m is mode for m in _get_current_function_mode_stack())


@contextlib.contextmanager
def sequence_parallel(group: Any, tokens: int, positions: bool = True) -> Iterator[SequenceParallelMode]:
    """Enter a :class:`SequenceParallelMode` around the forward of a sharded batch.

    Its backward needs no mode (the exchanges' backward is their own), except where a block is
    recomputed there: then use :func:`run_forwards_in`.

    Example::

        with sequence_parallel(group, tokens=ids.shape[1]) as mode:
            loss = model(ids).sum()
        loss.backward()
    """
    with SequenceParallelMode(group, tokens, positions) as mode:
        yield mode
