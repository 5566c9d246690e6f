"""Pad a batch's sequences to a multiple of a length: a few shapes instead of one per batch.

Under PipelineStrategy one trace serves every length where the model allows dynamic sizes, so dynamic
padding (each batch as long as its longest sample) costs nothing per length. Where a model fixes its
length (the trace is redone for each new one, with a warning saying so), padding to a multiple bounds
the shapes: ``pad_to_multiple_of=64`` gives at most ``max_len / 64`` of them. Hugging Face's
collators take the same ``pad_to_multiple_of``; this is the same for any batch of tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from lightning_parallel._picklable import HoldsUserCallables, describe


def pad_to_multiple(
    batch: Any, multiple: int, pad_values: Mapping[str, int | float] | None = None, dim: int = 1
) -> Any:
    """``batch`` with dimension ``dim`` of every tensor that has it padded (on the right) to a multiple.

    Args:
        batch: a tensor, or a dict / tuple / list of them (nested).
        multiple: the lengths to pad to a multiple of.
        pad_values: per dict key, the value to pad with (``{"labels": -100}``); others pad with 0.
        dim: the sequence dimension.

    Raises:
        ValueError: ``multiple`` is not a positive int.

    Example::

        >>> ones = torch.ones(2, 5, dtype=torch.long)
        >>> batch = {"input_ids": ones, "labels": ones}
        >>> padded = pad_to_multiple(batch, 8, {"labels": -100})
        >>> tuple(padded["input_ids"].shape), padded["labels"][0].tolist()
        ((2, 8), [1, 1, 1, 1, 1, -100, -100, -100])
    """
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ValueError(f"pad_to_multiple: multiple must be a positive int, got {multiple!r}")
    values = dict(pad_values or {})

    def pad(x: Any, key: Any = None) -> Any:
        if isinstance(x, Mapping):
            return type(x)({k: pad(v, k) for k, v in x.items()})
        if isinstance(x, (tuple, list)):
            return type(x)(pad(v) for v in x)
        if not torch.is_tensor(x) or x.dim() <= dim:
            return x
        missing = -x.shape[dim] % multiple
        if not missing:
            return x
        widths = [0, 0] * (x.dim() - dim - 1) + [0, missing]
        return F.pad(x, widths, value=values.get(key, 0))

    return pad(batch)


def padding_to_multiple(
    collate_fn: Callable[[list[Any]], Any], multiple: int, pad_values: Mapping[str, int | float] | None = None
) -> Callable[[list[Any]], Any]:
    """A collate function: ``collate_fn``'s batch padded with :func:`pad_to_multiple`.

    It pickles (a spawn launch sends the data loaders to the ranks) when ``collate_fn`` does; when
    ``collate_fn`` does not (a lambda), pickling it raises ``pickle.PicklingError`` naming it and the fix.

    Raises:
        ValueError: ``multiple`` is not a positive int.

    Example::

        DataLoader(data, batch_size=8, collate_fn=padding_to_multiple(pad_to_longest, 64, {"labels": -100}))
    """
    pad_to_multiple(torch.zeros(1, 1), multiple)  # (validates multiple now, not at the first batch)
    return _PaddingToMultiple(collate_fn, multiple, dict(pad_values or {}))


class _PaddingToMultiple(HoldsUserCallables):
    """What :func:`padding_to_multiple` returns: a class, not a closure, so that it pickles."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], multiple: int, pad_values: dict) -> None:
        self.collate_fn, self.multiple, self.pad_values = collate_fn, multiple, pad_values

    def __call__(self, samples: list[Any]) -> Any:
        return pad_to_multiple(self.collate_fn(samples), self.multiple, self.pad_values)

    def __repr__(self) -> str:
        return f"padding_to_multiple({describe(self.collate_fn)}, {self.multiple}, {self.pad_values})"

    def _user_callables(self) -> dict[str, Any]:
        return {f"padding_to_multiple(collate_fn={{}}, multiple={self.multiple})": self.collate_fn}
