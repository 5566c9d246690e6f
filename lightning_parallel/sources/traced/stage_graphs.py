"""What a traced stage's graph calls and reads, and pointing it at this rank's real tensors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import Pipe
from torch.export.unflatten import InterpreterModule


@dataclass(frozen=True)
class StageContents:
    """What one traced stage runs: the module paths its graph calls and the tensors it reads."""

    calls: tuple[str, ...]
    tensors: frozenset[str]  # paths of the parameters and buffers its graph reads (the module's own names)


def stage_contents(pipe: Pipe) -> list[StageContents]:
    """The contents of every stage of a traced pipe, in stage order."""
    out = []
    for index in range(pipe.num_stages):
        gm = pipe.get_stage_module(index)
        calls = tuple(path for path, _ in unit_calls(gm))
        out.append(StageContents(calls, frozenset(_tensors_read(gm))))
    return out


def unit_calls(gm: nn.Module, scope: str = "") -> list[tuple[str, nn.Module]]:
    """The modules a stage graph calls, by their paths in the user's module, down to the blocks.

    A call that holds blocks (numbered children of a list: ``model.layers.0``) is replaced by its own
    calls, so a Hugging Face stage reads ``model.model.embed_tokens, model.model.layers.0-1``, not
    ``model``; blocks themselves, and calls that hold none, are units as they are.
    """
    out: list[tuple[str, nn.Module]] = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        path, sub = f"{scope}.{node.target}" if scope else node.target, gm.get_submodule(node.target)
        inner = unit_calls(sub, path) if hasattr(sub, "graph") and not _is_block(path) else []
        out += inner if any(_is_block(p) for p, _ in inner) else [(path, sub)]
    return out


def _is_block(path: str) -> bool:
    return re.fullmatch(r".*\.\d+", path) is not None


def _tensors_read(gm: nn.Module) -> list[str]:
    """Every ``get_attr`` target in the stage graph and the graphs nested in it, as a full path."""
    return [
        f"{scope}.{n.target}" if scope else n.target
        for scope, mod in graph_modules(gm)
        for n in mod.graph.nodes
        if n.op == "get_attr"
    ]


def graph_modules(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stage module and the modules nested in it that run a graph, with their paths in it.

    Plain ``nn.Module`` containers hold only the aliases the tracer copies around: nothing runs them.
    """
    found, stack = [], [("", gm)]
    while stack:
        scope, mod = stack.pop()
        if isinstance(mod, (fx.GraphModule, InterpreterModule)):
            found.append((scope, mod))
        stack += [(f"{scope}.{name}" if scope else name, child) for name, child in mod.named_children()]
    return found


def point_at(stage_module: nn.Module, real: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    """Replace the twin's meta tensors in a stage module by this rank's real ones, by canonical name.

    Tensors the stage graph does not read (aliases the tracer leaves behind) are dropped; constants
    that export lifted out of ``forward`` (``torch.tensor(...)`` made there) keep their traced value.
    """
    read = set(_tensors_read(stage_module))
    named = [
        *stage_module.named_parameters(remove_duplicate=False),
        *stage_module.named_buffers(remove_duplicate=False),
    ]
    for path, _ in named:
        owner_path, _, leaf = path.rpartition(".")
        owner = stage_module.get_submodule(owner_path)
        slot = owner._parameters if leaf in owner._parameters else owner._buffers
        tensor = real.get(aliases.get(path, path))
        if tensor is not None:
            slot[leaf] = tensor
        elif path in read and path not in aliases and not slot[leaf].is_meta:
            continue  # a constant export lifted out of forward (litgpt Gemma's embedding scale): keep it
        elif path in read:
            raise RuntimeError(f"internal error: stage reads {path}, which this rank does not hold")
        else:
            del slot[leaf]
