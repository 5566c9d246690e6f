"""What the techniques that rewrite a traced stage's attention share: its graphs, and whether an explicit
mask is the causal pattern (what a Hugging Face decoder materialises under ``torch.export`` for an
unpadded batch, where its eager forward would have called ``is_causal=True``). Not a technique.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import nn

__all__ = ["graph_modules", "is_causal_pattern"]


def is_causal_pattern(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (boolean, or additive float) is the causal pattern of its last two dims everywhere.

    Example::

        >>> is_causal_pattern(torch.ones(1, 1, 3, 3, dtype=torch.bool).tril())
        True
        >>> is_causal_pattern(torch.zeros(3, 3))   # an additive mask letting everything through
        False
    """
    q, kv = mask.shape[-2:]
    if q != kv:
        return False
    causal = torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == causal).all())
    if not mask.is_floating_point():
        return False
    # Additive: 0 where a token may look, a large negative number (dtype min, or -inf) where not.
    masked = mask <= torch.finfo(mask.dtype).min / 2
    return bool(((mask == 0) == causal).all() and (masked == ~causal).all())


def graph_modules(stage_module: nn.Module) -> Iterator[nn.Module]:
    """A traced stage module and the modules nested in it that run a graph (their nodes are rewritten)."""
    return (m for m in stage_module.modules() if isinstance(getattr(m, "graph", None), fx.Graph))
