"""Where a model keeps its blocks: the list a traced pipeline is cut at (and the tensor-parallel
default plan is read from), and the class a Sequential repeats (what ``compile`` compiles there)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from torch import nn


def find_block_list(module: nn.Module) -> tuple[str, list[str]]:
    """The ``nn.ModuleList`` (or nested ``nn.Sequential``, or ``nn.ModuleDict`` keyed by block numbers, as
    torchtitan's models hold their layers) with most parameters: its path and children.

    Raises:
        ValueError: the module has no such list to split at.
    """
    lists = [
        (sum(p.numel() for p in m.parameters()), path, list(m._modules))
        for path, m in module.named_modules()
        if path and len(m._modules) > 0 and (isinstance(m, (nn.ModuleList, nn.Sequential)) or _numbered(m))
    ]
    if not lists:
        raise ValueError(
            f"{type(module).__name__} has no nn.ModuleList of blocks to split at: pass "
            f"PipelineStrategy(split_points=[...]) with the module paths where stages begin, or hold the "
            f"layers in a top-level nn.Sequential"
        )
    _, path, names = max(lists, key=lambda entry: entry[0])
    return path, names


def _numbered(m: nn.Module) -> bool:
    return isinstance(m, nn.ModuleDict) and all(name.isdigit() for name in m._modules)


def block_type(layers: Sequence[nn.Module]) -> type | None:
    """The class of the repeated blocks among ``layers`` (the most frequent class), None if none repeats.

    Read on the whole Sequential before the split, so every stage compiles the same kind of layer.

    Example::

        >>> seq = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.LayerNorm(2))
        >>> block_type(list(seq)).__name__
        'Linear'
        >>> block_type([nn.Linear(2, 2), nn.ReLU()]) is None
        True
    """
    counts = collections.Counter(type(m) for m in layers)
    if not counts:
        return None
    cls, count = counts.most_common(1)[0]
    return cls if count > 1 else None
