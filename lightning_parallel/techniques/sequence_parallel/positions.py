"""Each shard's positions: the sample's, not ``0 .. t-1``, without editing the model.

A model given ``t`` tokens numbers them ``0 .. t-1`` unless told otherwise; shard ``i`` of a sample
holds tokens ``i*t .. (i+1)*t - 1``. Two ways, chosen by the model:

* **a model whose forward takes** ``position_ids`` (Hugging Face decoders): :func:`pass_position_ids`
  gives each call the shard's own, unless the call passes some (a batch that carries
  ``position_ids`` has them sharded like any per-token tensor). The model then calls no ``arange``
  for them, and the ``arange`` calls it makes for other things (its mask's row, column and batch indices)
  are left alone;
* **a model that computes its positions** (nanoGPT's ``wpe(torch.arange(T))``, a rotary embedding's
  ``arange(T)``): the ``arange`` itself is offset (:func:`offset_positions`): in an eager forward by the
  function mode of :mod:`.eager`, where an integer ``arange`` from 0 in steps of 1 whose length is
  the shard's token count is taken for the positions; in a traced stage by :mod:`.graph`, where the
  ``arange``'s length is known to be the input's sequence size. The eager rule would also offset an
  unrelated integer ``arange`` of exactly that length (a batch index when the batch size equals
  ``t``): the project's GPTs make none, and ``positions=False`` turns it off.

Weighed and left: sharding after the embedding (every rank embeds the whole sequence, then keeps its
slice) fails on Hugging Face decoders, whose rotary ``cos``/``sin`` are computed for every position
before the blocks and handed to each, and it must know where the embedding ends; the ``arange`` rule on
a Hugging Face model offsets its mask's indices too (checked: an ``IndexError`` on a padded batch).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "arange_bounds",
    "offset_positions",
    "pass_position_ids",
    "shard_position_ids",
    "takes_position_ids",
]

_ARGUMENTS = ("start", "end", "step")


def arange_bounds(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """``(start, end, step)`` of a ``torch.arange`` / ``aten.arange`` call, as its overloads read them.

    Example::

        >>> arange_bounds((5,), {}), arange_bounds((2, 5), {"dtype": torch.long})
        ((0, 5, 1), (2, 5, 1))
    """
    numbers = [a for a in args if not isinstance(a, (torch.dtype, torch.device, torch.layout))]
    named = {k: kwargs[k] for k in _ARGUMENTS if k in kwargs}
    if len(numbers) == 1 and not named:
        return 0, numbers[0], 1
    values = dict(zip(_ARGUMENTS, numbers))
    values.update(named)
    return values.get("start", 0), values.get("end"), values.get("step", 1)


def offset_positions(positions: torch.Tensor, index: int) -> torch.Tensor:
    """``positions`` (``0 .. t-1``, shard ``index``'s own numbering) as the sample's: ``+ index * t``.

    Example::

        >>> offset_positions(torch.arange(4), 1).tolist()
        [4, 5, 6, 7]
    """
    return positions + index * positions.shape[-1] if index else positions


def is_positions(result: torch.Tensor, bounds: tuple[Any, Any, Any], tokens: int) -> bool:
    """Whether an ``arange`` with these bounds and this result numbers a shard of ``tokens`` tokens.

    Example::

        >>> is_positions(torch.arange(4), (0, 4, 1), 4), is_positions(torch.arange(4.0), (0, 4, 1), 4)
        (True, False)
    """
    start, end, step = bounds
    integer = not (result.is_floating_point() or result.is_complex() or result.dtype == torch.bool)
    return integer and _equals(start, 0) and _equals(step, 1) and _equals(end, tokens)


def _equals(number: Any, value: int) -> bool:
    if torch.is_tensor(number):
        return number.numel() == 1 and not number.is_floating_point() and int(number) == value
    return isinstance(number, int) and number == value


def takes_position_ids(module: nn.Module) -> bool:
    """Whether ``module``'s forward has a ``position_ids`` parameter (Hugging Face decoders' do).

    Example::

        >>> takes_position_ids(nn.Linear(2, 2))
        False
    """
    return "position_ids" in inspect.signature(module.forward).parameters


def shard_position_ids(tokens: torch.Tensor, index: int, seq_dim: int = 1) -> torch.Tensor:
    """The ``position_ids`` of shard ``index`` whose tokens are ``tokens``: ``(1, t)``, from ``index*t``.

    Example::

        >>> shard_position_ids(torch.zeros(2, 3), index=1).tolist()
        [[3, 4, 5]]
    """
    t = tokens.shape[seq_dim]
    return torch.arange(index * t, (index + 1) * t, device=tokens.device).unsqueeze(0)


def pass_position_ids(module: nn.Module, index: int, seq_dim: int = 1) -> RemovableHandle:
    """Give each call of ``module`` shard ``index``'s :func:`shard_position_ids`, unless it passes some.

    The shard's tokens are the call's ``input_ids`` (or ``inputs_embeds``, or its first positional tensor).

    Returns:
        The hook's handle: ``.remove()`` undoes it.

    Raises:
        ValueError: ``module.forward`` takes no ``position_ids``.

    Example::

        handle = pass_position_ids(hf_model, index=dist.get_rank(sp_group))
        hf_model(input_ids=shard_ids, labels=shard_labels)   # positions of the shard, not 0..t-1
    """
    if not takes_position_ids(module):
        raise ValueError(
            f"{type(module).__name__}.forward takes no position_ids: its positions are offset where it "
            "computes them (sequence_parallel(..., positions=True), or rewrite_stage on a traced stage)"
        )
    where = list(inspect.signature(module.forward).parameters).index("position_ids")

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is not None or len(args) > where:
            return args, kwargs
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if tokens is None:
            tokens = next((a for a in args if torch.is_tensor(a)), None)
        if tokens is None:
            return args, kwargs
        return args, {**kwargs, "position_ids": shard_position_ids(tokens, index, seq_dim)}

    return module.register_forward_pre_hook(hook, with_kwargs=True)
