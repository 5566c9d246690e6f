"""Relay values that skip stages through the stages between, so that each stage reads only its neighbour.

A transformer's ``forward`` often computes something once, before the blocks, and hands it to every
block: litgpt's ``cos, sin, mask``, the Hugging Face decoders' causal mask and rotary embeddings, a
padding mask given to ``forward``. Split at the blocks, stage 3 then reads a value made by stage 0 (or
a root input of ``forward``), and torch 2.13's traced stages cannot run that: a root input read after
stage 0 stops the forward ("expected non-root _RecvInfo but got root arg"), and a value read by two
later stages stops the backward ("Backward of skip connections not supported yet").

:func:`relay_skips` rewrites the traced pipe's graphs so that every stage passes such a value on:
stage ``m`` takes it as one more input and returns it as one more output, unchanged. The send and
receive, and the gradient's way back, are then torch's ordinary neighbour-to-neighbour ones. A relayed
tensor is the stage's input returned as is, so its gradient adds up in that input like any other use.
Stage 0 takes every root input of ``forward``, in order, because the schedule feeds it all of them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import Pipe


# torch workaround: https://github.com/pytorch/pytorch/issues/127964
#   canary: test_torch_traced_stages_give_a_later_stage_an_input_of_forward
# torch workaround: https://github.com/pytorch/pytorch/issues/127964
#   canary: test_torch_traced_stages_run_backward_of_a_value_read_past_the_next_stage
def relay_skips(pipe: Pipe) -> int:
    """Rewrite ``pipe`` in place so that stage ``k`` reads only stage ``k - 1``'s outputs; returns how many
    (value, stage) relays were added.

    Example::

        pipe = pipeline(gpt, example, split_spec={"h.1": SplitPoint.BEGINNING, "h.2": SplitPoint.BEGINNING})
        relay_skips(pipe)     # the mask built before h.0 now reaches stage 2 through stage 1
    """
    graph = pipe.split_gm.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    roots = [n for n in graph.nodes if n.op == "placeholder"]
    position = {node: k for k, node in enumerate(stages)}
    took_roots = _take_all_roots(pipe.split_gm, stages[0], roots)
    relayed: dict[tuple[fx.Node, int], fx.Node] = {}  # (value, stage) -> stage's output that carries it
    for k, stage in enumerate(stages[1:], start=1):
        for value in dict.fromkeys(stage.args):
            source = _source_stage(value, position)
            if source >= k - 1:
                continue
            carried = value
            for m in range(source + 1, k):
                if (value, m) not in relayed:
                    meta = _placeholder_for(pipe.split_gm, stage, value).meta
                    relayed[(value, m)] = _pass_through(pipe.split_gm, stages[m], carried, meta)
                carried = relayed[(value, m)]
            stage.replace_input_with(value, carried)
    reordered = [_in_output_order(pipe.split_gm, stage) for stage in stages[1:]]
    if took_roots or relayed or any(reordered):
        for stage in stages:
            pipe.split_gm.get_submodule(stage.target).recompile()
        graph.lint()
        pipe.split_gm.recompile()
    return len(relayed)


def _in_output_order(split_gm: nn.Module, stage: fx.Node) -> bool:
    """Order ``stage``'s inputs as the previous stage orders its outputs; returns whether they moved.

    The stages send and receive a step's tensors one after another without tags, so the receiver must
    post its receives in the order the sender sends: its inputs in the order of the sender's outputs.
    """
    args = list(stage.args)
    order = sorted(range(len(args)), key=lambda i: _output_index(args[i]))
    if order == list(range(len(args))):
        return False
    placeholders = _placeholders(_stage_graph(split_gm, stage))
    _put_in_order([placeholders[i] for i in order])
    stage.args = tuple(args[i] for i in order)
    return True


def _put_in_order(placeholders: list[fx.Node]) -> None:
    """Move a graph's placeholders into this order (their order is the stage's signature)."""
    body = next(n for n in placeholders[0].graph.nodes if n.op != "placeholder")
    for placeholder in placeholders:
        body.prepend(placeholder)  # moves it before the first non-placeholder, after those moved already


def _output_index(value: fx.Node) -> int:
    return value.args[1] if value.target is operator.getitem else 0


def _source_stage(value: fx.Node, position: dict[fx.Node, int]) -> int:
    """The stage that makes ``value``: -1 for a root input of ``forward``."""
    if value.op == "placeholder":
        return -1
    made_by = value.args[0] if value.target is operator.getitem else value
    if made_by not in position:
        raise RuntimeError(f"internal error: stage input {value.name} is made outside the stages")
    return position[made_by]


def _stage_graph(split_gm: nn.Module, stage: fx.Node) -> fx.Graph:
    return split_gm.get_submodule(stage.target).graph


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _placeholder_for(split_gm: nn.Module, stage: fx.Node, value: fx.Node) -> fx.Node:
    """The placeholder inside ``stage`` that receives ``value`` (a stage's args and placeholders are 1:1)."""
    return _placeholders(_stage_graph(split_gm, stage))[list(stage.args).index(value)]


def _take_all_roots(split_gm: nn.Module, first: fx.Node, roots: list[fx.Node]) -> bool:
    """Make stage 0 take exactly the root inputs, in order: the schedule calls it with all of them.

    Returns whether stage 0 changed.
    """
    if list(first.args) == roots:
        return False
    strays = [v.name for v in first.args if v not in roots]
    if strays:
        raise RuntimeError(f"internal error: stage 0 reads {strays}, which are not inputs of forward")
    graph = _stage_graph(split_gm, first)
    inner = dict(zip(first.args, _placeholders(graph), strict=True))
    for root in roots:
        if root not in inner:
            inner[root] = graph.placeholder(_free_name(graph, root.name))
            inner[root].meta.update(root.meta)
    _put_in_order([inner[root] for root in roots])
    first.args = tuple(roots)
    return True


def _pass_through(split_gm: nn.Module, stage: fx.Node, value: fx.Node, meta: dict[str, Any]) -> fx.Node:
    """Give ``stage`` ``value`` as an input (unless it already has it) and return it as a new output.

    Returns the node in the pipe's graph that stands for the new output.
    """
    graph = _stage_graph(split_gm, stage)
    if value in stage.args:
        inner = _placeholder_for(split_gm, stage, value)
    else:
        last = _placeholders(graph)[-1]
        with graph.inserting_after(last):
            inner = graph.placeholder(_free_name(graph, f"relay_{value.name}"))
        inner.meta.update(meta)
        stage.args = (*stage.args, value)
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    outer = stage.graph
    if isinstance(result, (tuple, list)):
        output.args = ((*result, inner),)
        index = len(result)
    else:
        # One output so far, used as the call's value itself: make it a tuple, and its users read item 0.
        output.args = ((result, inner),)
        with outer.inserting_after(stage):
            item0 = outer.call_function(operator.getitem, (stage, 0))
        stage.replace_all_uses_with(item0, delete_user_cb=lambda user: user is not item0)
        index = 1
    getitems = [u for u in stage.users if u.target is operator.getitem]
    with outer.inserting_after(getitems[-1] if getitems else stage):
        return outer.call_function(operator.getitem, (stage, index))


def _free_name(graph: fx.Graph, base: str) -> str:
    taken = {n.name for n in graph.nodes} | {str(n.target) for n in graph.nodes if n.op == "placeholder"}
    name, suffix = base, 0
    while name in taken:
        suffix += 1
        name = f"{base}_{suffix}"
    return name
