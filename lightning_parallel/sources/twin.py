"""A module's meta twin (the same structure and ties, every tensor on the meta device), and its ties.

Tracing, sizing the stages and the memory planner run on twins: they cost no memory and leave the
user's module untouched. Ties are named once: :func:`alias_table` maps every name of a tensor to its
canonical one, and :func:`retie` makes a module share what the table says it shares.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (ties kept).

    Each submodule is a shallow copy (its other attributes are shared), so building it costs no
    memory and tracing it never touches the user's module.

    Example::

        twin = meta_twin(gpt)
        twin.lm_head.weight is twin.wte.weight      # True when gpt ties them
    """
    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, nn.Module] = {}

    def twin_tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in tensors:
            meta = torch.empty_like(t, device="meta")
            tensors[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
        return tensors[id(t)]

    def twin_module(m: nn.Module) -> nn.Module:
        if id(m) not in modules:
            copy = m.__class__.__new__(m.__class__)
            copy.__dict__.update(m.__dict__)
            modules[id(m)] = copy
            copy._parameters = {k: None if v is None else twin_tensor(v) for k, v in m._parameters.items()}
            copy._buffers = {k: None if v is None else twin_tensor(v) for k, v in m._buffers.items()}
            copy._modules = {k: None if v is None else twin_module(v) for k, v in m._modules.items()}
            # Its own hook dicts: hooks added to the user's module later (parallelize_module's, on
            # DTensors) must not run when the twin is traced again.
            for name, value in m.__dict__.items():
                if name.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(
                    value, dict
                ):
                    setattr(copy, name, value.__class__(value))
        return modules[id(m)]

    twin = twin_module(module)
    for copy in modules.values():
        _rebind_callables(copy, modules)
    return twin


def _rebind_callables(copy: nn.Module, twins: Mapping[int, nn.Module]) -> None:
    """Point the module-calling attributes the copy shares with the original at the twin's modules.

    A block that keeps ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))`` (minGPT) or a bound
    ``other.forward`` as an attribute would otherwise run the user's modules, with real weights the
    export lifts as constants (no gradient reaches them): the twin gets its own lambda, closing over
    the twin's modules, and the method bound to the twin's module.
    """
    for name, value in list(vars(copy).items()):
        if isinstance(value, types.MethodType) and id(value.__self__) in twins:
            setattr(copy, name, types.MethodType(value.__func__, twins[id(value.__self__)]))
        elif isinstance(value, types.FunctionType) and value.__closure__:
            cells = [c.cell_contents if _filled(c) else None for c in value.__closure__]
            if any(isinstance(v, nn.Module) and id(v) in twins for v in cells):
                closure = tuple(
                    types.CellType(twins[id(v)]) if isinstance(v, nn.Module) and id(v) in twins else c
                    for v, c in zip(cells, value.__closure__)
                )
                rebound = types.FunctionType(
                    value.__code__, value.__globals__, value.__name__, value.__defaults__, closure
                )
                rebound.__kwdefaults__ = value.__kwdefaults__
                setattr(copy, name, rebound)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def to_meta(tree: Any) -> Any:
    """The same structure with every tensor replaced by an empty meta tensor of its shape and dtype."""
    return torch.utils._pytree.tree_map(
        lambda t: torch.empty_like(t, device="meta") if torch.is_tensor(t) else t, tree
    )


def alias_table(module: nn.Module) -> dict[str, str]:
    """Every name by which ``module`` reaches a parameter or buffer -> its canonical name.

    The canonical name is the one ``named_parameters()`` / ``named_buffers()`` report (the first
    registration), as in a single-device optimizer's ``param_names``.

    Example::

        >>> gpt = nn.ModuleDict({"wte": nn.Embedding(10, 4), "lm_head": nn.Linear(4, 10, bias=False)})
        >>> gpt.lm_head.weight = gpt.wte.weight  # tied
        >>> alias_table(gpt)["lm_head.weight"]
        'wte.weight'
    """
    table: dict[str, str] = {}
    for named in (
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    ):
        first: dict[int, str] = {}
        for name, tensor in named:
            table[name] = first.setdefault(id(tensor), name)
    return table


def retie(module: nn.Module, aliases: Mapping[str, str]) -> None:
    """Point every alias present in ``module`` at its canonical tensor again (``to_empty`` unties them)."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    for alias, canonical in aliases.items():
        if alias != canonical and alias in tensors and canonical in tensors:
            owner, _, leaf = alias.rpartition(".")
            module.get_submodule(owner)._parameters[leaf] = tensors[canonical]
