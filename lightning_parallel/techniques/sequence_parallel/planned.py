"""What sequence parallelism does to the planner's numbers (the technique's ``stage_costs``, ``memory``,
``time`` and ``variants`` read these; pure functions of the measured model, duck-typed).

The planner measures the model on the whole sequence (``T`` tokens a sample). A rank of a group of ``k``
holds ``T/k`` of every sample's tokens through everything but the attention core, and inside it the whole
sequence for ``heads/k`` of the heads: what it saves and computes per micro-batch of ``b`` samples is, to
within the constant terms, what ``b/k`` samples of the whole sequence save and compute (token-wise work
``b T/k``; attention ``b T^2 heads/k``). So:

* **memory**: every per-token byte of a stage (what a micro-batch saves, the output it keeps, its
  transients, its receive buffers) ``/ k``, after every other technique's ``stage_costs`` (recomputation's
  included); plus, while one attention exchanges, its send and receive buffers (two copies of the
  query's shard, the largest exchanged tensor: :func:`exchange_bytes`, a transient). The parameters,
  gradients and optimizer state stay whole; FSDP2 and ZeRO-1 shard them over the ``"shard"`` and
  ``"optimizer_shard"`` roles, which the sequence ranks join (``layout/ranks.py``): their own ``memory``
  reads the role's size. The gathered query/key/value ("all tokens, my heads") are what the attention
  saves, the measured ones ``/ k``.
* **time**: each stage's units at ``b/k`` samples of their measured lines (the constant per-call part
  kept; what runs before the first unit ``/ k``), and per attention and micro-batch four all-to-alls in
  forward (query, key, value "tokens to heads", the output back; key and value at ``kv_heads/heads`` of
  the query), the same four in backward, and four more in backward where the attention's unit is
  recomputed, each moving ``(k - 1)/k`` of its tensor (``Links.all_to_all``); the rank's micro-batch is
  ``b/k`` samples from there on (the stage boundary's send, recomputation's forward again). The
  gradients' reduction spans ``dp x k`` ranks (the ``"gradients"`` role: ``replicas.py`` reads its size).
* **search**: ``k`` among the sizes that divide every attention's query and key/value heads, that divide
  the devices a pipeline rank's replicas share (pipeline x tensor left aside) and the sequence, where the
  model declares its heads (:func:`attentions`) and the job would split every attention (:func:`splits`),
  and the sequence is at least :data:`LONG_SEQUENCE` tokens or the search asks for it
  (:data:`SPLIT_SEQUENCES`, the technique's search option: ``Search(sequence_parallel=...)``,
  ``--sequence-parallel``).

Not modelled: a traced Hugging Face model's ``(b, 1, t, t)`` causal mask is ``k^2`` smaller on a rank,
not ``k`` (over-counted: on the safe side); the two tiny collectives of a ``labels=`` loss's boundary
labels; any overlap of the exchanges with compute (each is charged in full).

An attention is found by its module (:func:`attentions`): a class named ``...Attention`` (Hugging Face's
``LlamaAttention``, ...) or ``...Attn``, or a module with its own head count (``heads``, ``num_heads``,
``n_head``: a GPT block's), the outermost of nested ones.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Iterable
from typing import Any

from torch import nn

from lightning_parallel.techniques.contract import SearchOption
from lightning_parallel.techniques.sequence_parallel.heads import (
    KV_HEADS,
    QUERY_HEADS,
    int_attr,
    sizes_that_work,
)

LONG_SEQUENCE = 2048
"""Tokens a sample from which the search tries sequence parallelism without being asked: below it a
sample's activations rarely outweigh the model's state, and splitting the batch is as good and cheaper."""

SPLIT_SEQUENCES = SearchOption(
    "sequence_parallel",
    None,
    "try splitting each sequence over k ranks (sequence_parallel_size) where the model's heads allow: auto "
    f"(default) from {LONG_SEQUENCE} tokens a sample, yes at any length, no never",
    choices={"auto": None, "yes": True, "no": False},
)
"""Whether the search splits the sequence (``sequence_parallel_size``) where the measured model's heads
allow: ``None`` (default, ``auto``) where its sequence is long (:data:`LONG_SEQUENCE`), ``True`` whatever
its length, ``False`` never."""

_OWN_HEADS = ("heads", "num_heads", "n_head")

Heads = tuple[int, int] | None
"""An attention's ``(query heads, key/value heads)``; None: not declared."""


def attentions(module: nn.Module) -> list[Heads]:
    """The attentions in ``module`` (outermost ones), each with its head counts where it declares them.

    Example::

        >>> class SelfAttention(nn.Module):
        ...     heads = 4
        >>> attentions(nn.Sequential(SelfAttention(), nn.Linear(2, 2), SelfAttention()))
        [(4, 4), (4, 4)]
    """
    found: list[tuple[str, Heads]] = []
    for path, sub in module.named_modules():
        if any(path.startswith(f"{p}.") or p == "" for p, _ in found):
            continue
        name = type(sub).__name__
        own = int_attr(sub, _OWN_HEADS)
        if own is None and not (name.endswith("Attention") or name.endswith("Attn")):
            continue
        config = getattr(sub, "config", None)
        holder = config if int_attr(config, QUERY_HEADS) is not None else sub
        query = int_attr(holder, QUERY_HEADS)
        kv = int_attr(holder, KV_HEADS)
        found.append((path, None if query is None else (query, kv or query)))
    return [heads for _, heads in found]


def unit_attentions(layout: Any) -> dict[str, list[Heads]]:
    """The attentions of each unit of the planner's measured model (``facts.layout``), by unit name."""
    return {u.name: found for u in layout.units if (found := attentions(u.module))}


def sizes(layout: Any) -> list[int]:
    """The group sizes above 1 that split every attention's heads, or ``[]`` where some attention does not
    declare them, none is found or one is not split at run time (:func:`splits`).

    Example::

        sizes(facts.layout)      # a Llama with 32 heads and 8 key/value heads: [2, 4, 8]
    """
    every = [h for found in unit_attentions(layout).values() for h in found]
    if not every or any(h is None for h in every) or not all(splits(u.module) for u in layout.units):
        return []
    common = set.intersection(*(set(sizes_that_work(*h)) for h in every if h is not None))
    return sorted(k for k in common if k > 1)


def splits(module: nn.Module) -> bool:
    """Whether the job would split every attention in ``module`` (what the search checks before it tries
    ``k``; a plan given by hand is sized as asked, and the job refuses what it cannot split): a Hugging
    Face attention with ``attn_implementation="sdpa"``, any other whose class's ``forward`` (or an
    enclosing module's) calls ``scaled_dot_product_attention``.

    Example::

        splits(facts.layout.units[3].module)     # False: an eager Hugging Face attention
    """
    for path, sub in module.named_modules():
        if int_attr(sub, _OWN_HEADS) is None and not type(sub).__name__.endswith(("Attention", "Attn")):
            continue
        config = getattr(sub, "config", None)
        if int_attr(config, QUERY_HEADS) is not None:
            if getattr(config, "_attn_implementation", None) not in ("sdpa", None):
                return False
            continue
        parts = path.split(".") if path else []
        enclosing = [module.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
        if not any(_calls_sdpa(type(m)) for m in [*sub.modules(), *enclosing]):
            return False
    return True


@functools.cache
def _calls_sdpa(cls: type) -> bool:
    try:
        return "scaled_dot_product_attention" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def shard(stage: Any, k: int) -> Any:
    """A stage's costs (``StageCosts``, a dataclass) on one rank of ``k``: its per-token bytes ``/ k``
    (rounded up), its parameters and their gradients as they were.

    Example::

        shard(costs[0], 2).per_microbatch      # half of costs[0].per_microbatch
    """
    fields = ("per_microbatch", "kept_output", "forward_transient", "backward_transient", "recv_buffers")
    return dataclasses.replace(stage, **{f: math.ceil(getattr(stage, f) / k) for f in fields})


def exchange_bytes(facts: Any, units: Iterable[str], micro_batch: float) -> int:
    """The send and receive buffers of one exchange of the largest attention input among ``units`` on the
    whole sequence (twice the query: its width is the unit's output's, the hidden states): ``/ k`` on a
    rank, with the rest of the stage's transients."""
    found = unit_attentions(facts.layout)
    hidden = [facts.probe.unit(n).outputs.at(micro_batch) for n in units if n in found]
    return 2 * int(max(hidden, default=0))


def all_to_alls(facts: Any, links: Any, unit: str, k: int, micro_batch: float) -> float:
    """Seconds of one pass's all-to-alls of ``unit``'s attentions on one rank of ``k`` (``micro_batch``
    samples of the whole sequence, before the split): per attention the query, key and value to the
    heads' layout and the output back, each its shard of the unit's hidden states (key and value at
    ``kv_heads / heads`` of it)."""
    hidden = facts.probe.unit(unit).outputs.at(micro_batch) / k
    seconds = 0.0
    for heads in unit_attentions(facts.layout).get(unit, []):
        kv = hidden * heads[1] / heads[0] if heads is not None else hidden
        seconds += 2 * links.all_to_all(k, hidden) + 2 * links.all_to_all(k, kv)
    return seconds


def recomputed(layout: Any, select: Any) -> set[str]:
    """The units ``activation_checkpointing=select`` recomputes, as the strategy selects them (``True``: a
    GPT's blocks; every unit of a split ``nn.Sequential``): their attentions exchange again in backward.

    Example::

        recomputed(facts.layout, ["h.1"])        # {"h.1"}
    """
    if select is False or select is None:
        return set()
    units = [(u.name, u.module) for u in layout.units]
    if select is True:
        return {u.name for u in layout.blocks()} if layout.kind == "blocks" else {n for n, _ in units}
    if callable(select):
        return {n for n, m in units if select(n, m)}
    return set(select)


def tokens_split(tokens: int, k: int) -> bool:
    """Whether a sequence of ``tokens`` splits into ``k`` equal shards (0: not known, taken as yes)."""
    return tokens == 0 or tokens % k == 0
