"""Sequence parallelism for a traced stage: its graph rewritten to call Ulysses attention.

A traced stage is an export graph (an ``fx.GraphModule``, or ``InterpreterModule`` graphs nested as the
user's modules were) in which ``F.scaled_dot_product_attention`` is one node,
``aten.scaled_dot_product_attention.default``. :func:`rewrite_stage` replaces each such node by a call
of :func:`~.attention.ulysses_attention` over the group, with the node's own arguments (a mask the
trace materialised, as Hugging Face decoders do under export, is judged at run time by :mod:`.masks`),
and, with ``positions``, offsets each position ``arange``: an integer ``arange`` from 0 whose end is
the size of the stage inputs' sequence dimension (the symbol export gave it, ``s27``, in a dynamic
trace: an ``arange`` over the batch has another; in a static one, the number ``tokens``). The stage
then carries its own exchanges: no mode to enter, and a block recomputed in backward runs them again.

Example::

    counts = rewrite_stage(stage_module, sp_group, positions=True)
    counts.attention   # the SDPA nodes replaced (0: the stage has no attention to split)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from lightning_parallel.techniques.attention_masks import graph_modules
from lightning_parallel.techniques.sequence_parallel.attention import ulysses_attention
from lightning_parallel.techniques.sequence_parallel.positions import offset_positions

__all__ = ["Rewritten", "rewrite_stage"]

aten = torch.ops.aten
_ATTENTION = aten.scaled_dot_product_attention.default
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)


@dataclass(frozen=True)
class Rewritten:
    """What :func:`rewrite_stage` changed: SDPA nodes made Ulysses calls, position ``arange`` nodes offset."""

    attention: int
    positions: int


class UlyssesCall:
    """The target of a rewritten attention node: SDPA's arguments in, Ulysses attention over ``group``."""

    __name__ = "ulysses_attention"

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return ulysses_attention(*args, **kwargs, group=self.group)


class ShardPositions:
    """The target of a position node: the ``arange`` of the shard's tokens offset to the sample's."""

    __name__ = "shard_positions"

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return offset_positions(positions, dist.get_rank(self.group))


def rewrite_stage(
    stage_module: nn.Module,
    group: Any,
    positions: bool = True,
    seq_dim: int = 1,
    tokens: int | None = None,
) -> Rewritten:
    """Make every attention node of a traced stage Ulysses attention over ``group``; offset its positions.

    Args:
        stage_module: a traced stage (its graphs are changed in place and recompiled).
        group: the sequence-parallel process group, its ranks in shard order.
        positions: offset the position ``arange`` nodes (off for a model given ``position_ids``).
        seq_dim: the sequence dimension of the stage's inputs.
        tokens: a static trace's shard length (its ``arange`` ends are literals, not input sizes).

    Returns:
        How many attention and position nodes were rewritten.

    Raises:
        ValueError: a static trace (``tokens`` given) whose micro-batch size is ``tokens`` too.

    Example::

        rewrite_stage(pipe.get_stage_module(0), sp_group)
    """
    attention = offsets = 0
    sizes = _sequence_sizes(stage_module, seq_dim, tokens) if positions else set()
    for module in graph_modules(stage_module):
        graph: fx.Graph = module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is _ATTENTION:
                with graph.inserting_before(node):
                    call = graph.call_function(UlyssesCall(group), node.args, dict(node.kwargs))
                call.meta = dict(node.meta)
                node.replace_all_uses_with(call)
                graph.erase_node(node)
                attention += 1
                changed = True
            elif node.target in _ARANGE and _numbers_the_sequence(node, sizes):
                with graph.inserting_after(node):
                    shifted = graph.call_function(ShardPositions(group), (node,))
                node.replace_all_uses_with(shifted, delete_user_cb=lambda user, s=shifted: user is not s)
                offsets += 1
                changed = True
        if changed:
            graph.lint()
            (module.graph_module if getattr(module, "graph_module", None) is not None else module).recompile()
    return Rewritten(attention, offsets)


def _sequence_sizes(stage_module: nn.Module, seq_dim: int, tokens: int | None) -> set[str]:
    """The sizes (as export wrote them: ``s27``, or a static trace's number) of the stage inputs'
    sequence dimension."""
    sizes = {str(tokens)} if tokens is not None else set()
    graph = getattr(stage_module, "graph", None)
    for node in graph.nodes if isinstance(graph, fx.Graph) else ():
        value = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(value, torch.Tensor) or value.dim() <= seq_dim:
            continue
        if not isinstance(value.shape[seq_dim], int):
            sizes.add(str(value.shape[seq_dim]))
        if tokens is not None and value.shape[0] == tokens and seq_dim != 0:
            raise ValueError(
                f"sequence parallelism: this static trace's inputs have {tokens} samples and {tokens} tokens "
                f"a shard, so an arange over the tokens cannot be told from one over the samples: trace "
                f"with dynamic sizes, or with a micro-batch size other than {tokens}"
            )
    return sizes


def _numbers_the_sequence(node: fx.Node, sizes: set[str]) -> bool:
    """Whether an ``arange`` node counts ``0 .. n-1`` in integers, ``n`` one of the sequence ``sizes``."""
    args = list(node.args)
    start, _, step = (0, None, 1) if len(args) == 1 else (*args, 1)[:3]
    value = node.meta.get("val")
    if start != 0 or step != 1 or not isinstance(value, torch.Tensor) or value.dim() != 1:
        return False
    integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return integer and str(value.shape[0]) in sizes
