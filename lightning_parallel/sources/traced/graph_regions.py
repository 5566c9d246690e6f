"""Inline the no-grad and autocast regions that torch.export wraps in higher-order ops, before the split.

``torch.export`` turns a ``with torch.no_grad():`` block (or an ``@torch.no_grad()`` method, or
``torch.autocast(enabled=False)``) into one ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast``
node whose body is a graph module read with ``get_attr``. Every rotary embedding of the Hugging Face
decoders (Llama, Qwen2, Mistral, Gemma, GPT-NeoX...) is such a region, and torch 2.13's pipeline
frontend then builds stages that cannot run: its outliner turns the body and one of its inputs into
placeholders that nobody passes ("missing 2 required positional arguments: 'unsqueeze_default' and
'submod_1'", pytorch#184361). Inlining each region between a switch of the mode and its restore, as
export's graphs did before those ops existed, gives stages that run the same ops in the same mode.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled


@fx.node.has_side_effect
def enter_grad_mode(enabled: bool) -> bool:
    """Switch autograd on or off; returns the mode to restore (a node of the graph, kept by DCE)."""
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enabled)
    return previous


@fx.node.has_side_effect
def exit_grad_mode(previous: bool, *_after: Any) -> None:
    """Restore the grad mode; ``_after`` are the region's results, so it runs after all of them."""
    torch._C._set_grad_enabled(previous)


@fx.node.has_side_effect
def enter_autocast(device_type: str, dtype: Any, enabled: bool, cache_enabled: Any) -> Any:
    mode = torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    mode.__enter__()
    return mode


@fx.node.has_side_effect
def exit_autocast(mode: Any, *_after: Any) -> None:
    mode.__exit__(None, None, None)


# torch workaround: https://github.com/pytorch/pytorch/issues/184361
#   canary: test_torch_pipeline_splits_a_model_whose_no_grad_region_feeds_a_later_stage
def inline_wrapped_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every grad-mode / autocast region op in ``gm`` by its body, between enter and exit calls.

    Nested regions are inlined too. Returns ``gm`` (changed in place), so it can serve as the
    ``split_policy`` of torch's ``Pipe.from_tracing``.

    Example::

        ep = torch.export.export(model, (idx,))
        gm = inline_wrapped_regions(ep.module())     # no wrap_with_set_grad_enabled nodes left
    """
    while _inline_one(gm):
        pass
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline_one(gm: fx.GraphModule) -> bool:
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and _is_region(n.target)), None)
    if node is None:
        return False
    graph = gm.graph
    if node.target is wrap_with_set_grad_enabled:
        (enabled, body_node, *inputs), enter, exit_ = node.args, enter_grad_mode, exit_grad_mode
        enter_args: tuple[Any, ...] = (enabled,)
    else:
        enter_args, body_node, inputs = tuple(node.args[:4]), node.args[4], list(node.args[5:])
        enter, exit_ = enter_autocast, exit_autocast
    body = getattr(gm, body_node.target)
    with graph.inserting_before(node):
        entered = graph.call_function(enter, enter_args)
        entered.meta.update(node.meta)
        results = _copy_body(gm, body, inputs, node.meta)
        left = graph.call_function(exit_, (entered, *_tensor_nodes(results)))
        left.meta.update(node.meta)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise RuntimeError(
            f"internal error: a region's result {node.name} is used other than by item (torch changed "
            f"wrap_with_set_grad_enabled's graphs; checked against 2.13)"
        )
    graph.erase_node(node)
    if not body_node.users:
        graph.erase_node(body_node)
    return True


def _copy_body(gm: fx.GraphModule, body: fx.GraphModule, inputs: list[Any], meta: dict) -> list[Any]:
    """Copy ``body``'s nodes into ``gm``'s graph at the insertion point; returns its outputs' nodes."""
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for placeholder, value in zip(placeholders, inputs, strict=True):
        env[placeholder] = value
    outputs: Any = None
    for n in body.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outputs = fx.node.map_arg(n.args[0], lambda a: env[a])
            continue
        if n.op == "get_attr":  # a nested region's body: give it a name in gm
            name = _free_attr(gm, n.target)
            setattr(gm, name, getattr(body, n.target))
            env[n] = gm.graph.get_attr(name)
        else:
            env[n] = gm.graph.node_copy(n, lambda a: env[a])
        env[n].meta = {**meta, **n.meta}
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _tensor_nodes(values: list[Any]) -> list[fx.Node]:
    return [v for v in values if isinstance(v, fx.Node)]


def _is_region(target: Any) -> bool:
    return target is wrap_with_set_grad_enabled or target is wrap_with_autocast


def _free_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_inlined_{k}"
    return name
