"""Causal attention for traced stages: an attention whose explicit mask is the causal pattern runs as
``is_causal=True``.

A Hugging Face decoder called eagerly passes ``F.scaled_dot_product_attention`` no mask for an unpadded
batch (``is_causal=True``), but under ``torch.export`` it materialises the ``(b, 1, t, t)`` causal mask
and hands it to the attention, which then keeps it (as a float bias on the CPU) for backward: memory that
grows with the square of the sequence (measured: a Llama of width 64, 2 layers, one sample of 2048
tokens peaked at 69.5 MiB traced against 34.5 MiB eager). Each attention node of a traced stage is
given :class:`CausalWhenMasked` instead, which checks the mask it gets at run time
(:func:`~lightning_parallel.techniques.attention_masks.is_causal_pattern`: one comparison of the mask
with the pattern) and calls the attention with ``is_causal=True`` and no mask when it is causal, with the
mask as it is otherwise (padding, packed sequences: unchanged). The same attention as the eager model's
(its kernel too), so nothing to configure: on for every traced stage, except under ``compile`` (a
data-dependent branch breaks its graphs) and where sequence parallelism has rewritten the attention
already (before this in the list).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from lightning_parallel.techniques.attention_masks import graph_modules, is_causal_pattern
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.job import Job

__all__ = ["TECHNIQUE", "CausalWhenMasked", "rewrite_causal_masks"]

_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


class CausalWhenMasked:
    """SDPA's arguments in; ``is_causal=True`` without the mask where the mask is the causal pattern.

    Example::

        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> mask = torch.ones(4, 4, dtype=torch.bool).tril()
        >>> torch.allclose(CausalWhenMasked()(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, mask))
        True
    """

    __name__ = "causal_when_masked"

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        causal = (
            attn_mask is not None
            and not is_causal
            and query.shape[-2] == key.shape[-2]
            and is_causal_pattern(attn_mask)
        )
        if causal:
            attn_mask, is_causal = None, True
        gqa = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **gqa
        )


def rewrite_causal_masks(stage_module: nn.Module) -> int:
    """Give every attention node of a traced stage that gets a mask :class:`CausalWhenMasked`; how many.

    Example::

        rewrite_causal_masks(pipe.get_stage_module(0))
    """
    count = 0
    for module in graph_modules(stage_module):
        graph: fx.Graph = module.graph
        changed = False
        for node in list(graph.nodes):
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            if node.op != "call_function" or node.target is not _ATTENTION or mask is None:
                continue
            with graph.inserting_before(node):
                call = graph.call_function(CausalWhenMasked(), node.args, dict(node.kwargs))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            count += 1
            changed = True
        if changed:
            graph.lint()
            (module.graph_module if getattr(module, "graph_module", None) is not None else module).recompile()
    return count


class CausalAttention(Technique):
    """A traced stage's attention given the causal pattern as a mask runs as ``is_causal=True`` (no field:
    always, on traced stages, without ``compile``).

    Example::

        PipelineStrategy(pipeline_size=2)   # a Hugging Face decoder's stages keep no (b, 1, t, t) mask
    """

    name, fields = "causal_attention", ()

    def stages(self, view: Any, job: Job) -> str | None:
        if not view.graphs or job.plan.compiled:
            return None
        view.each_stage(lambda stage: rewrite_causal_masks(stage.module))
        return None


TECHNIQUE = CausalAttention()
