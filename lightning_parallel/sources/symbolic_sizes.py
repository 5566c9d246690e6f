"""Sizes in a graph traced with dynamic dimensions: computed inside each stage, evaluated for a new input.

A forward exported with a dynamic sequence length (and micro-batch size) reads those sizes with
``aten.sym_size.int(input_ids, 1)`` in the first stage and uses them everywhere (``view(x, [b, t, 4,
8])`` in every block). Cut into stages, every later stage would receive the sizes as inputs, and a
pipeline stage sends tensors only. :func:`localize_sizes` makes each stage compute the sizes it uses
from a tensor it already has (its input ``x`` of shape ``(b, t, 32)`` knows ``t``), so stages exchange
exactly the tensors they exchanged before. :func:`evaluate_shape` turns a symbolic shape of the traced
program into the concrete one for a given input, without running anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.distributed.pipelining._IR import aten_pipe_split_alias

_ASSERTS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default)


def is_symbolic(value: Any) -> bool:
    """A ``SymInt`` / ``SymFloat`` / ``SymBool`` (a size, or a value computed from sizes)."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def localize_sizes(gm: fx.GraphModule) -> fx.GraphModule:
    """Recompute in each stage every symbolic size it uses from a tensor of its own; returns ``gm``.

    Stages are the runs of nodes between torch's ``pipe_split`` markers (what ``pipeline()`` cuts).
    Runtime size assertions export adds (``_assert_scalar``) are dropped, since each would pull its
    sizes across a stage boundary: :class:`SizeConstraints` checks them for each new input shape,
    before any stage runs.

    Raises:
        RuntimeError: a size a later stage uses cannot be recomputed there (no tensor of that stage
            has it as a dimension, and it is not computed from such sizes).
    """
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ASSERTS]:
        gm.graph.erase_node(node)
    stage_of = _stages(gm.graph)
    local: dict[tuple[int, fx.Node], fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op == "output" or node not in stage_of:
            continue
        for arg in _symbolic_args(node):
            if stage_of.get(arg, 0) != stage_of[node]:
                copy = _recompute(gm.graph, arg, stage_of[node], node, stage_of, local)
                node.replace_input_with(arg, copy)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _stages(graph: fx.Graph) -> dict[fx.Node, int]:
    """The stage index of every node but placeholders and the output, as ``pipeline()`` will cut."""
    stage, out = 0, {}
    for node in graph.nodes:
        if (node.op, node.target) == ("call_function", aten_pipe_split_alias):
            stage += 1
        if node.op not in ("placeholder", "get_attr", "output"):
            out[node] = stage
    return out


def _symbolic_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) if _is_size(a) else None)
    return list(dict.fromkeys(found))


def _is_size(node: fx.Node) -> bool:
    return is_symbolic(node.meta.get("val"))


def _recompute(
    graph: fx.Graph,
    size: fx.Node,
    stage: int,
    before: fx.Node,
    stage_of: Mapping[fx.Node, int],
    local: dict[tuple[int, fx.Node], fx.Node],
) -> fx.Node:
    """A node of ``stage``, placed before ``before``, that computes the value of ``size`` there."""
    if (stage, size) in local:
        return local[(stage, size)]
    source = _tensor_with_dim(graph, size.meta["val"], stage, before, stage_of)
    with graph.inserting_before(before):
        if source is not None:
            tensor, dim = source
            copy = graph.call_function(torch.ops.aten.sym_size.int, (tensor, dim))
        elif size.op == "call_function" and not _reads_tensors(size):
            args, kwargs = fx.node.map_arg(
                (size.args, size.kwargs),
                lambda a: _recompute(graph, a, stage, before, stage_of, local) if _is_size(a) else a,
            )
            copy = graph.call_function(size.target, args, kwargs)
        else:
            raise RuntimeError(
                f"internal error: stage {stage} uses the size `{size.name}` ({size.meta['val']}) that only "
                f"an earlier stage can compute, and no tensor of stage {stage} has it as a dimension"
            )
    # The outliner that follows groups nodes by the module they were traced in: the user's.
    copy.meta.update({k: v for k, v in before.meta.items() if k in ("nn_module_stack", "stack_trace")})
    copy.meta["val"] = size.meta["val"]
    local[(stage, size)] = copy
    return copy


def _reads_tensors(node: fx.Node) -> bool:
    found: list[bool] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(torch.is_tensor(a.meta.get("val"))))
    return any(found)


def _tensor_with_dim(
    graph: fx.Graph, value: Any, stage: int, before: fx.Node, stage_of: Mapping[fx.Node, int]
) -> tuple[fx.Node, int] | None:
    """A tensor ``stage`` already holds before ``before`` with a dimension equal to ``value``.

    What a stage holds: the tensors it computes, and those it receives (an earlier stage's tensors
    that some node of this stage reads). Reading a size must never make a tensor cross a boundary.
    """
    expr = value.node.expr if isinstance(value, torch.SymInt) else None
    if expr is None:
        return None
    for node in graph.nodes:
        if node is before:
            break
        val = node.meta.get("val")
        if not torch.is_tensor(val) or not _held_by(node, stage, stage_of):
            continue
        for dim, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return node, dim
    return None


def _held_by(node: fx.Node, stage: int, stage_of: Mapping[fx.Node, int]) -> bool:
    if stage_of.get(node) == stage:
        return True
    return any(stage_of.get(user) == stage for user in node.users)


@dataclass(frozen=True)
class SizeConstraints:
    """What the sizes of an exported program must satisfy for it to be the model's program.

    ``torch.export`` records a guard on a dynamic size (``if t > 4:`` in forward) as a range of its
    symbol (``t >= 5``) or, where no range expresses it, as a runtime assertion in the graph; the
    program computes the model only for sizes that satisfy them. (Every dynamic size is at least 2:
    export specialises sizes of 0 and 1.)
    """

    ranges: tuple[tuple[Any, int | None, int | None], ...] = ()  # (symbol, lowest, highest or None)
    assertions: tuple[Any, ...] = ()  # sympy relations of the symbols

    @classmethod
    def of(cls, program: torch.export.ExportedProgram) -> SizeConstraints:
        ranges = tuple(
            (symbol, _bound(vr.lower), _bound(vr.upper)) for symbol, vr in program.range_constraints.items()
        )
        assertions = tuple(
            node.args[0].meta["val"].node.expr
            for node in program.graph.nodes
            if node.op == "call_function"
            and node.target is torch.ops.aten._assert_scalar.default
            and isinstance(node.args[0], fx.Node)
            and is_symbolic(node.args[0].meta.get("val"))
        )
        return cls(ranges, assertions)

    def range(self, size: torch.SymInt) -> str:
        """The range of one dynamic size, as ``[2, 4]`` or ``[5, ...)``."""
        for symbol, lowest, highest in self.ranges:
            if symbol == size.node.expr:
                return f"[{lowest}, {highest}]" if highest is not None else f"[{lowest}, ...)"
        return "[2, ...)"

    def allow(self, values: Mapping[Any, int]) -> bool:
        """Whether sizes with these symbol values satisfy every range and assertion."""
        for symbol, lowest, highest in self.ranges:
            value = values.get(symbol)
            if value is None:
                continue
            if (lowest is not None and value < lowest) or (highest is not None and value > highest):
                return False
        return all(_holds(a, values) for a in self.assertions)


def _holds(assertion: Any, values: Mapping[Any, int]) -> bool:
    result = sympy.sympify(assertion).xreplace(values)
    return bool(result) if result in (sympy.true, sympy.false) or isinstance(result, bool) else True


def _bound(value: Any) -> int | None:
    """A range's end as an int, or None for torch's infinities (``int_oo``: no bound)."""
    if value is None:
        return None
    try:
        return int(value)
    except (AttributeError, OverflowError, TypeError, ValueError):  # int_oo, oo: their int() fails
        return None


def symbol_values(shapes: Sequence[Sequence[Any]], concrete: Sequence[Sequence[int]]) -> dict[Any, int]:
    """The value of every size symbol, read from the traced inputs' shapes against concrete ones.

    Raises:
        ValueError: a static dimension of the trace differs from the concrete input's (the program
            does not serve that shape), or the inputs disagree on a symbol's value.
    """
    values: dict[Any, int] = {}
    for index, (traced, real) in enumerate(zip(shapes, concrete)):
        if len(traced) != len(real):
            raise ValueError(f"input {index} has {len(real)} dimensions, traced with {len(traced)}")
        for dim, (t, r) in enumerate(zip(traced, real)):
            if not isinstance(t, torch.SymInt):
                if int(t) != int(r):
                    raise ValueError(f"input {index} dim {dim} is {r}, traced as the constant {t}")
                continue
            expr = t.node.expr
            if isinstance(expr, sympy.Symbol) and values.setdefault(expr, int(r)) != int(r):
                raise ValueError(f"input {index} dim {dim} is {r}, but {expr} is {values[expr]}")
    return values


def evaluate_shape(shape: Sequence[Any], values: Mapping[Any, int]) -> tuple[int, ...]:
    """A traced (symbolic) shape or stride, evaluated for the given symbol values."""
    return tuple(_evaluate(s, values) for s in shape)


def evaluate_stride(
    shape: Sequence[int], stride: Sequence[Any], values: Mapping[Any, int]
) -> tuple[int, ...]:
    """A traced (symbolic) stride for an evaluated ``shape``. A dimension of size 1 is never stepped over,
    so its stride is free: an input that was a slice (a sequence shard of a batch of one sample: stride
    the whole length) may have traced it as a symbol of its own, which no input size gives; it is then the
    contiguous stride.

    Example::

        >>> evaluate_stride((1, 4), (7, 1), {})
        (7, 1)
    """
    out = []
    for d, s in enumerate(stride):
        try:
            out.append(_evaluate(s, values))
        except ValueError:
            if shape[d] != 1:
                raise
            out.append(math.prod(shape[d + 1 :]))
    return tuple(out)


def _evaluate(size: Any, values: Mapping[Any, int]) -> int:
    if not isinstance(size, torch.SymInt):
        return int(size)
    result = sympy.sympify(sympy.sympify(size.node.expr).xreplace(values))
    if not result.is_number:
        raise ValueError(f"the size {size} depends on a value not among the inputs' sizes")
    return int(result)
