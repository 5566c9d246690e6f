"""What sequence parallelism checks in the user's model, each with the fix: the heads it declares, the
attentions its stages split, and ``labels=`` handed to a module that would shift them on its own.

The technique (``technique.py``) calls them at three points of a job: before the split, the head
counts the model declares (:func:`declared_heads`, each checked against ``k`` on every rank alike);
after the first schedule step, the attentions the stages split (:class:`FoundAttention`: a model
whose attention is not SDPA would train each rank on its own shard of the sequence, silently); at a
call with ``labels=``, a module of the user's holding a Hugging Face causal LM that shifts them
(:func:`warn_labels_to_a_holder`: its loss would drop the label across each shard boundary). Apart
from the technique's contract because each is about the model, not the plan: what it declares, which
attention it runs, where its loss shifts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.techniques.sequence_parallel.heads import KV_HEADS, QUERY_HEADS, int_attr


class FoundAttention:
    """The attentions this rank's stages split; after the first step, a pipeline that split none refused.

    A context around each schedule step (reused: it checks at the first exit without an error).

    A stage may hold none (the head alone): under a pipeline the counts are summed, one all-reduce over
    every rank after the first schedule step (each is there), so every rank raises together.
    """

    def __init__(self, size: int, what: str, device: torch.device) -> None:
        self.size, self.what, self.device = size, what, device
        self.counts: list[Callable[[], int]] = []
        self.checked = False

    def __enter__(self) -> FoundAttention:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self.checked or kind is not None:  # (once; not over another error)
            return
        self.checked = True
        total = float(sum(count() for count in self.counts))
        if self.size > 1:
            # Over the world, not the pipeline: every rank is here after its first schedule step, and
            # every pipeline holds the same model (the sum is the pipelines' count times theirs). An
            # all-reduce on the pipeline's own group here hung on gloo (4 ranks, pp 2 x sp 2), behind
            # the schedule's point-to-point traffic on that group.
            found = torch.tensor([total], device=self.device)
            dist.all_reduce(found)
            total = float(found.item())
        if total == 0:
            raise RuntimeError(
                f"sequence parallelism found no attention to split in {self.what}: it looks for calls of "
                "torch.nn.functional.scaled_dot_product_attention (its aten op in a traced stage), and none "
                "ran, so each rank's attention saw only its own shard of the sequence. A Hugging Face "
                "model: load it with attn_implementation='sdpa'; a model of yours: compute attention with "
                "F.scaled_dot_product_attention(q, k, v, is_causal=True) instead of softmax(q @ k^T)"
            )


def declared_heads(module: nn.Module) -> dict[str, tuple[int, int]]:
    """The attention head counts ``module``'s submodules declare: ``{path: (query heads, kv heads)}``.

    A Hugging Face model's ``config`` (``num_attention_heads``, ``num_key_value_heads``), else a module's
    own integer attribute (``heads``, ``num_heads``, ``n_head``). Example: ``{"model": (4, 2)}``.
    """
    found: dict[str, tuple[int, int]] = {}
    for path, sub in module.named_modules():
        config = getattr(sub, "config", None)
        holder = config if int_attr(config, QUERY_HEADS) is not None else sub
        query = int_attr(holder, QUERY_HEADS)
        if query is None or any(p == "" or path.startswith(p + ".") for p in found):
            continue  # (the outermost declaration: a Hugging Face model's config, not its layers')
        kv = int_attr(holder, KV_HEADS)
        found[path] = (query, kv if kv is not None else query)
    return {f"{type(module.get_submodule(p)).__name__} at {p or 'the module'!r}": v for p, v in found.items()}


def shifting_inside(path: str, shifting: dict[str, str]) -> list[str]:
    """The shifting models held inside the module at ``path`` (``""``: the whole module), as
    ``"path (Class)"``."""
    return [f"{p} ({name})" for p, name in shifting.items() if not path or p.startswith(f"{path}.")]


def warn_labels_to_a_holder(path: str, inside: list[str]) -> None:
    """``labels=`` given to a module of the user's that holds a shifting Hugging Face model: if it passes
    them on, that model's loss shifts each shard's labels on its own and drops the label across each
    shard boundary (one per shard and sample): training differs from one device's, silently. Said once."""
    if not inside:
        return
    called = f"`{path}`" if path else "the model"
    warnings.warn(
        f"sequence parallelism: labels= is passed to {called}, which holds a Hugging Face causal LM whose "
        f"loss shifts its labels ({', '.join(inside)}). If {called} passes them on, each shard's loss "
        f"shifts its own labels and loses the next shard's first one: the loss and gradients differ from "
        f"one device's. Call the Hugging Face model with labels= from training_step (the strategy then "
        f"gives each shard the labels across its boundary as shift_labels), or use a dict batch with "
        f"'labels' and pass shift_labels on (the strategy adds them to the batch before the split)",
        stacklevel=2,
    )
