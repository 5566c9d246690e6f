"""Ulysses attention: ``F.scaled_dot_product_attention``'s arguments on a shard of the sequence, its
result on the same shard, computed over every token of the sample.

Each rank of a group of ``k`` holds ``t`` consecutive tokens. Around the attention core, one all-to-all
per input turns "my tokens, all heads" into "all tokens, heads/k" (query, key, value), attention runs
over the whole sequence on those heads, and one all-to-all turns the output back: four all-to-alls of
``1/k`` of the attention's activations each, in forward and again in backward. With grouped-query
attention the key and value are exchanged with their own (fewer) heads: ``k`` must divide both counts.

The query's all-to-all carries each rank's verdict on its attention mask (:mod:`.masks`), so when one
rank cannot take its mask every rank of the group raises at the same point, and none waits for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.techniques.sequence_parallel.exchange import heads_to_tokens, tokens_to_heads
from lightning_parallel.techniques.sequence_parallel.heads import check_heads
from lightning_parallel.techniques.sequence_parallel.masks import causal_over_all_tokens

__all__ = ["ulysses_attention"]


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    group: Any,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over every token of the sequence, called with this rank's shard.

    Takes SDPA's arguments (``(b, heads, t, d)`` inputs, heads on dim 1) and returns what one device's
    SDPA returns for this rank's ``t`` query positions, output and gradients (dropout draws its own
    masks). ``k = group size`` must divide the query heads and the key/value heads.

    Raises:
        ValueError: ``k`` does not divide the head counts (the sizes that work named), or the inputs are
            not 4-D ``(b, heads, t, d)``.
        RuntimeError: an attention mask that is not the causal pattern, on any rank of the group (the
            same point on every rank; :mod:`.masks` says why and what to do).

    Example::

        out = ulysses_attention(q, k, v, is_causal=True, group=sp_group)   # each rank: its tokens
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 4:
            raise ValueError(
                f"sequence parallelism: the attention's {name} has shape {tuple(x.shape)}; it takes "
                "(batch, heads, tokens, head_dim) inputs, as F.scaled_dot_product_attention's are"
            )
    check_heads(dist.get_world_size(group), query.shape[1], key.shape[1])
    causal, refusal = causal_over_all_tokens(attn_mask, is_causal, query.shape[2])
    q, verdicts = tokens_to_heads(query, group, flag=float(refusal is not None))
    if verdicts is not None and bool(verdicts.any()):
        raise RuntimeError(refusal or _refused_elsewhere(verdicts))
    k, _ = tokens_to_heads(key, group)
    v, _ = tokens_to_heads(value, group)
    gqa = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(q, k, v, None, dropout_p, causal, scale=scale, **gqa)
    return heads_to_tokens(out, group)


def _refused_elsewhere(verdicts: torch.Tensor) -> str:
    ranks = [i for i, v in enumerate(verdicts.tolist()) if v]
    return (
        f"sequence parallelism: the attention mask on shard(s) {ranks} of this sequence-parallel group is "
        "not the causal pattern (their ranks raise the details): only causal attention carries over to "
        "every token of the sample; pad on the right with labels -100 and leave the padding mask out"
    )
