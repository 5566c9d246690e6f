"""Which attention patterns survive the split: a mask made for a shard is not the sequence's mask.

After the all-to-all, a rank's attention runs over all ``k*t`` tokens of the sample, but a mask the
model built inside its forward was built for the shard's ``t`` tokens (and for its own rows only). The
decision here (the test suite checks it): **causal attention is the one masked pattern the technique
computes**. ``is_causal=True``, or an explicit mask equal to the causal pattern of the shard's length
(what Hugging Face models materialise for an unpadded batch under ``torch.export``), becomes
``is_causal=True`` over all the tokens; no mask and ``is_causal=False`` stays full attention (exact
too). Any other mask is refused, with the fix: padding belongs on the right, labelled ``-100``, with the
padding mask left out (:mod:`~lightning_parallel.techniques.sequence_parallel.shards` replaces a
batch's right-padding ``attention_mask`` by ones, where that is exact: causal attention never lets a
labelled token see the padding after it). A sliding window shorter than the sequence would be
silently widened (each shard's own block still looks causal), so :func:`check_window` refuses it from
the model's config.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_parallel.techniques.attention_masks import is_causal_pattern

__all__ = ["causal_over_all_tokens", "check_window", "is_causal_pattern", "refused_mask"]


def causal_over_all_tokens(
    attn_mask: torch.Tensor | None, is_causal: bool, tokens: int
) -> tuple[bool, str | None]:
    """``(is_causal over every token, None)`` for the attention of a shard of ``tokens`` tokens, or
    ``(False, why it is refused)``.

    Example::

        >>> causal_over_all_tokens(None, True, 4)
        (True, None)
        >>> causal_over_all_tokens(torch.ones(4, 4, dtype=torch.bool).tril(), False, 4)
        (True, None)
    """
    if attn_mask is None:
        return bool(is_causal), None
    if not is_causal and tuple(attn_mask.shape[-2:]) == (tokens, tokens) and is_causal_pattern(attn_mask):
        return True, None
    return False, refused_mask(attn_mask, tokens)


def refused_mask(attn_mask: torch.Tensor, tokens: int) -> str:
    """The error for an attention mask that is not the causal pattern of a shard of ``tokens`` tokens."""
    return (
        f"sequence parallelism: an attention got an explicit mask of shape {tuple(attn_mask.shape)} on a "
        f"shard of {tokens} tokens that is not the causal pattern; after the all-to-all each rank attends "
        "over every token of the sample, and only causal attention (is_causal=True, or a mask equal to "
        "the causal pattern) carries over to them. Padding: pad on the right with labels -100 and leave "
        "the padding mask out (shard_batch replaces a dict batch's right-padding 'attention_mask' by ones); "
        "left padding, packed sequences, sliding windows and bidirectional masks are not supported"
    )


def check_window(module: nn.Module, length: int) -> None:
    """Refuse a sequence longer than the sliding attention window of a (Hugging Face) model's config.

    Each shard's own block of a sliding-window mask looks causal while the window is longer than the
    shard, so the attention would silently see further back than the model does. Duck-typed
    (``config.sliding_window``, ``config.layer_types``): transformers is not imported.

    Raises:
        ValueError: naming the window and the length.

    Example::

        check_window(hf_model, 8192)   # Mistral (window 4096): ValueError
    """
    config: Any = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    sliding = window is not None and (not types or any("sliding" in str(t) for t in types))
    if sliding and length > window:
        raise ValueError(
            f"sequence parallelism computes full causal attention over each sequence of {length} tokens, "
            f"but {type(module).__name__} attends within a sliding window of {window} tokens: train on "
            f"sequences of at most {window} tokens, or without sequence_parallel_size"
        )
