"""Tensor parallelism for traced stages: each stage's export graph runs on DTensors (:func:`split_traced`).

A traced stage is an export graph: it calls none of the user's modules (``parallelize_module``'s
hooks never run) and its view ops carry the *whole* tensors' shapes (``view(b, t, 4, 8)`` for four
heads). Run on DTensors, both are fine: a DTensor keeps the global shape, so the baked shapes stay
true, and DTensor's sharding propagation computes each op on the local shards, redistributing where
an op needs it. The split weights are the DTensors ``parallelize_module`` puts on the user's modules;
the stage's inputs enter as replicated DTensors and its outputs leave as plain (replicated) tensors,
so the pipeline sends what it sent before.

Left to itself, propagation picks the cheapest layout op by op, not Megatron's: after a row-wise
projection it keeps the block's output a partial sum and later gathers whole weights to multiply it.
So the layouts a module's ``ParallelStyle`` would give its input and output (column-wise: replicated
in, sharded on the last dim out; row-wise: sharded in, replicated out, one all-reduce) are written into
the graph around the op that reads the module's weight (:func:`place_split_ops`). Then a block costs
Megatron's two all-reduces in forward, and the heads never leave their rank.

Two ops of torch 2.13 have no DTensor sharding rule: the CPU flash-attention kernels behind
``scaled_dot_product_attention`` (the CUDA ones have theirs) and ``_assert_tensor_metadata`` (a check
export records for ``.to(dtype)``); :func:`register_missing_shardings` gives them one, with torch's
public ``register_sharding``.

The traced source prepares each stage's graph per traced program; this module's work is done on each as
it is prepared, through the stage view (``StageSource.each_stage``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication, register_sharding
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_map

from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource
from lightning_parallel.techniques.tensor_parallel.apply import apply_held_styles
from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan

aten = torch.ops.aten

# The ops whose weight argument tells which module's style applies: (op, index of input, of weight).
_SPLIT_OPS = {aten.linear.default: (0, 1), aten.embedding.default: (1, 0)}


def split_traced(stages: StageSource, plan: TensorPlan, mesh: DeviceMesh) -> None:
    """Split the modules that hold this rank's traced stages with ``plan``'s styles, then, as each stage
    is prepared, write the layouts into its graph and run it on DTensors (:class:`TensorParallelGraph`).

    Example::

        split_traced(runner.stages, plan, mesh.device_mesh["tp"])
    """
    register_missing_shardings()
    styles: dict[str, ParallelStyle] = {}
    for held in stages.modules:
        styles.update(apply_held_styles(held, plan, mesh))

    def split(stage: PreparedStage) -> None:
        place_split_ops(stage.graph_modules, styles, stages.aliases)
        graphs = [module for _, module in stage.graph_modules]
        stage.runs = TensorParallelGraph(stage.module if stage.runs is None else stage.runs, mesh, graphs)

    stages.each_stage(split)


def place_split_ops(
    graphs: Sequence[tuple[str, nn.Module]], styles: Mapping[str, ParallelStyle], aliases: Mapping[str, str]
) -> set[str]:
    """Write each split module's input and output layouts into the graph around the op reading its weight.

    Args:
        graphs: the modules of a traced stage that run a graph, with their paths in the stage module
            (``PreparedStage.graph_modules``): changed in place and recompiled.
        styles: module path (canonical, in the user's module) -> the ``ColwiseParallel`` /
            ``RowwiseParallel`` it is split with.
        aliases: the unsplit module's alias table (name -> canonical name).

    Returns:
        The split modules whose ops were placed. One whose weight the graph reads in another op (a
        ``F.linear`` on a transposed weight...) is warned about: it runs right, with the layouts DTensor
        picks (often more communication).

    Example::

        place_split_ops(stage.graph_modules, {"h.0.attn.q": ColwiseParallel()}, alias_table(model))
    """
    placed: set[str] = set()
    read: set[str] = set()
    for scope, mod in graphs:
        graph: fx.Graph = mod.graph
        owners = {
            n: aliases.get(path, path).rpartition(".")[0]
            for n in graph.nodes
            if n.op == "get_attr"
            for path in (f"{scope}.{n.target}" if scope else n.target,)
        }
        read |= {o for o in owners.values() if o in styles}
        changed = False
        for node in list(graph.nodes):
            where = _SPLIT_OPS.get(node.target) if node.op == "call_function" else None
            owner = owners.get(node.args[where[1]]) if where is not None else None
            if owner not in styles:
                continue
            embedding = node.target is aten.embedding.default
            before, after = style_layouts(styles[owner], owner, embedding=embedding)
            with graph.inserting_before(node):
                node.update_arg(where[0], graph.call_function(to_layout, (node.args[where[0]], *before)))
            with graph.inserting_after(node):
                out = graph.call_function(to_layout, (node, *after))
            node.replace_all_uses_with(out, delete_user_cb=lambda user, out=out: user is not out)
            placed.add(owner)
            changed = True
        if changed:
            graph.lint()
            (mod.graph_module if hasattr(mod, "graph_module") else mod).recompile()
    if read - placed:
        warnings.warn(
            f"tensor parallelism: the traced graph reads the split weights of {sorted(read - placed)} in ops "
            f"other than linear/embedding, so their layouts could not be written around them: they run "
            f"correctly, with the layouts DTensor picks (often more communication). Split such modules "
            f"with tensor_parallel_plan, or leave them whole",
            stacklevel=2,
        )
    return placed


def style_layouts(
    style: ParallelStyle, owner: str, embedding: bool = False
) -> tuple[tuple[str, int], tuple[str, int]]:
    """The (input, output) layouts of a module split with ``style`` in a traced stage, as the style's
    own hooks would give them (an embedding split row-wise reads whole token ids).

    Raises:
        ValueError: a style a traced stage cannot place (its effect lives in module hooks).

    Example::

        style_layouts(RowwiseParallel(), "h.0.attn.proj")   # (("shard", -1), ("replicate", 0))
    """
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        raise ValueError(
            f"`{owner}` is split with {type(style).__name__}, but a traced forward takes ColwiseParallel "
            f"and RowwiseParallel only (their layouts are written into the graph; other styles act through "
            f"module hooks, which a traced stage never runs): use those two, or hold the layers in one "
            f"top-level nn.Sequential"
        )
    if isinstance(style, ColwiseParallel):
        given = style.desired_input_layouts[0]
    else:
        given = Replicate() if embedding else Shard(-1)
    return _layout(given), _layout(style.output_layouts[0])


def _layout(p: Placement) -> tuple[str, int]:
    if isinstance(p, Replicate):
        return "replicate", 0
    if isinstance(p, Shard):
        return "shard", p.dim
    raise ValueError(f"a traced forward's tensor-parallel layouts are Replicate() or Shard(dim), got {p!r}")


def to_layout(x: Any, kind: str, dim: int) -> Any:
    """``x`` redistributed over its mesh to ``Replicate()`` (``kind="replicate"``) or ``Shard(dim)``.

    What the graph calls around a split op; a plain tensor (the fake run that finds the stages'
    shapes) passes unchanged.
    """
    if not isinstance(x, DTensor):
        return x
    target = Replicate() if kind == "replicate" else Shard(dim % x.ndim)
    if all(p == target for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [target] * x.device_mesh.ndim)


class TensorParallelGraph(nn.Module):
    """Runs a traced stage module on DTensors: plain tensors in and out, its split weights DTensors.

    Args:
        graph: the stage module (its split weights already DTensors over ``mesh``, its split ops placed
            by :func:`place_split_ops`), or what runs it.
        mesh: the tensor-parallel mesh.
        graphs: the modules that run its graphs (``PreparedStage.graph_modules``): where its parameters
            sit, found once (the tensors there are read at each call: a sharded root points them at the
            gathered parameters before it runs this).

    Example::

        stage = PipelineStage(TensorParallelGraph(stage_module, mesh["tp"], graphs), index, n, device)
    """

    def __init__(self, graph: nn.Module, mesh: DeviceMesh, graphs: Sequence[nn.Module]) -> None:
        super().__init__()
        self.graph, self.mesh = graph, mesh
        self._slots = [(mod._parameters, name) for mod in graphs for name in mod._parameters]

    def forward(self, *args: Any) -> Any:
        return run_on_dtensors(self.graph, args, self.mesh, self._slots)


def run_on_dtensors(
    graph: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh, slots: Sequence[tuple[dict[str, Any], str]]
) -> Any:
    """``graph(*args)`` with the tensors in ``args`` entering as replicated DTensors, plain ones coming out.

    Every tensor-parallel rank holds the same input (its peers get the same data), so the input is
    wrapped without communication; its gradient leaves summed over the ranks (each holds a partial
    one after a column-wise op). Each output is made whole (``Replicate``) and then local. Runs inside
    :class:`TensorParallelStep` (constants made inside forward, masks and positions, are plain tensors).
    ``slots``: where the graph's parameters sit (the owning module's parameter dict, the name).
    """

    def enter(t: Any) -> Any:
        if torch.is_tensor(t) and not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return t

    # The whole (unsplit) parameters enter as replicated DTensors too, for the call only: so their
    # gradients come back plain (summed where partial), as the optimizer and the replicas expect.
    whole = [(slot, name, slot[name]) for slot, name in slots]
    whole = [(slot, name, p) for slot, name, p in whole if p is not None and not isinstance(p, DTensor)]
    try:
        for slot, name, p in whole:
            slot[name] = enter(p)
        return tree_map(_leave, graph(*tree_map(enter, args)))
    finally:
        for slot, name, p in whole:
            slot[name] = p


def _leave(t: Any) -> Any:
    if not isinstance(t, DTensor):
        return t
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()


# torch workaround: no upstream issue found
#   canary: test_dtensor_implicit_replication_nests
class TensorParallelStep:
    """Around a schedule step of tensor-parallel traced stages: their graphs mix plain tensors and DTensors.

    Forward makes plain constants (a causal mask, positions, rotary tables) and meets the DTensors;
    backward multiplies DTensor gradients with what forward saved. DTensor treats the plain ones as
    replicated (they are: every tensor-parallel rank makes the same) only when asked to. One context
    for the whole step: torch's ``implicit_replication`` does not nest (its exit turns it off). Entered
    again at each step (the technique's ``step_context``).

    Example::

        with TensorParallelStep():
            schedule.step(x, target=y)
    """

    def __enter__(self) -> None:
        self._inside = implicit_replication()
        self._inside.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._inside.__exit__(*exc)


_registered = False


# torch workaround: no upstream issue found
#   canary: test_dtensor_has_sharding_rules_for_cpu_flash_attention_and_tensor_metadata_checks
def register_missing_shardings() -> None:
    """Give DTensor a sharding rule for the two ops of a traced stage that torch 2.13 has none for.

    Idempotent; called before a tensor-parallel traced stage first runs.
    """
    global _registered
    if _registered:
        return
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)(_attention_forward)
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(_attention_backward)
    register_sharding(aten._assert_tensor_metadata.default)(_assert_metadata)
    _registered = True


def _attention_placements(mask: Any) -> list[tuple[Placement, list[Placement | None]]]:
    """Attention runs per (batch, head): all replicated, heads sharded (dim 1) or batch sharded (dim 0).

    A mask broadcast over the sharded dim (size 1 there) stays replicated.
    """
    out: list[tuple[Placement, list[Placement | None]]] = []
    for p in (Replicate(), Shard(1), Shard(0)):
        masks: list[Placement | None] = []
        if mask is not None:
            masks = [p if isinstance(p, Shard) and mask.shape[p.dim] > 1 else Replicate()]
        out.append((p, masks))
    return out


def _attention_forward(query, key, value, *args, attn_mask=None, **kwargs):
    # (output, logsumexp) from (query, key, value, dropout_p, is_causal; attn_mask)
    return [([p, p], [p, p, p, *[None] * len(args), *m]) for p, m in _attention_placements(attn_mask)]


def _attention_backward(grad, query, key, value, out, lse, *args, attn_mask=None, **kwargs):
    # (grad_query, grad_key, grad_value) from (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal; mask)
    return [([p] * 3, [p] * 6 + [*[None] * len(args), *m]) for p, m in _attention_placements(attn_mask)]


def _assert_metadata(tensor, *args, **kwargs):
    # A check with no output: any layout of its tensor is fine.
    shards = [Shard(d) for d in range(tensor.ndim)]
    return [([], [p, *[None] * len(args)]) for p in (Replicate(), Partial(), *shards)]
