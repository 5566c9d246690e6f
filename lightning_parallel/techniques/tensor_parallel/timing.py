"""Tensor parallelism timed in place, for the planner: one block split over the tensor-parallel ranks, run as
its stage runs it (:func:`measure_block`).

A split Sequential's stage calls the user's modules: the block is split with ``parallelize_module`` and
called (the styles' hooks, local tensors between them, the local head counts). A traced stage calls none
of them: it runs an exported graph of aten ops on DTensors (``traced.py``), which dispatches many more
DTensor ops than the eager block on DTensors does (its views, transposes and rotary products are ops of
their own). So for a traced layout the block is exported as the traced source exports a model
(``torch.export``, unflattened into one graph per module), its graph pointed at the split block's
DTensor weights, the layouts written around its split ops (``place_split_ops``) and run on DTensors
(``TensorParallelGraph``) inside ``TensorParallelStep``: what a traced stage runs per block. A block export
cannot capture (a keyword input it refuses...) is timed eagerly on DTensors instead, which the times say.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from lightning_parallel.techniques.ledgers import Line, TimeBench, UnitSample
from lightning_parallel.techniques.tensor_parallel.traced import (
    TensorParallelGraph,
    TensorParallelStep,
    place_split_ops,
)

# recomputed -> the block's outputs: one call of the split block on one size's inputs, as its stage calls it.
BlockCall = Callable[[bool], Any]
Inputs = dict[int, tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class BlockTimes:
    """A split block's seconds per micro-batch, forward and backward, as lines in its samples;
    ``recompute``: what its backward takes more under activation checkpointing (its forward run again on
    DTensors, in backward, where the forward's dispatch caches no longer hold); ``note``: how it ran where
    that is not as its stage runs it (a traced block export could not capture, timed eagerly)."""

    forward: Line
    backward: Line
    recompute: Line | None = None
    note: str = ""


@dataclass(frozen=True)
class TensorParallelTimes:
    """Tensor parallelism measured in place: per tensor-parallel size, one split block's times.

    Example::

        times = TECHNIQUE.measure(bench)      # on every rank of the job
        times.blocks[2].forward.at(8)         # seconds of a block's forward on 8 samples over 2 ranks
    """

    blocks: dict[int, BlockTimes] = field(default_factory=dict)

    @property
    def note(self) -> str:
        """What the log says beside "measured in place" (how a block ran, where not as its stage runs it)."""
        return "; ".join(sorted({b.note for b in self.blocks.values() if b.note}))


def measure_block(sample: UnitSample, plan: Any, mesh: DeviceMesh, bench: TimeBench) -> BlockTimes:
    """A copy of the block ``sample`` split with ``plan``'s styles over ``mesh``, timed forward, forward +
    backward, and forward + backward under activation checkpointing at each of the bench's sizes, as its
    stage runs it: a split Sequential's stage calls the modules (:func:`module_calls`); a traced stage
    runs the block's exported graph on DTensors (:func:`graph_calls`).

    Raises:
        ValueError: the plan splits nothing in the block.

    Example::

        measure_block(bench.samples[0], default_plan(model.layers, "layers", 2), mesh["tp"], bench)
    """
    name = sample.name
    styles = {p[len(name) + 1 :]: s for p, s in plan.styles.items() if p.startswith(f"{name}.")}
    if not styles:
        raise ValueError(f"the tensor-parallel plan splits nothing in {name}")
    block = copy.deepcopy(sample.module).to(bench.device)
    inputs = {size: bench.inputs(sample, size) for size in sorted(sample.inputs)}
    if bench.layout == "sequential":
        heads = {p[len(name) + 1 :]: c for p, c in plan.head_counts.items() if f"{p}.".startswith(f"{name}.")}
        calls, note = module_calls(block, styles, heads, mesh, inputs), ""
    else:
        bench.dtensor_rules()
        calls, note = graph_calls(block, styles, mesh, inputs)
    forward, backward, again = [], [], []
    for size, call in calls.items():
        with TensorParallelStep() if bench.layout != "sequential" else contextlib.nullcontext():
            alone = bench.timed(lambda c=call: c(False))
            both = bench.timed(lambda c=call: TimeBench.backward(c(False)))
            recomputed = bench.timed(lambda c=call: TimeBench.backward(c(True)))
        forward.append((size, alone))
        backward.append((size, both - alone))
        again.append((size, max(0.0, recomputed - both)))
    return BlockTimes(Line.through(forward), Line.through(backward), Line.through(again), note)


def module_calls(
    block: nn.Module,
    styles: dict[str, ParallelStyle],
    heads: dict[str, dict[str, int]],
    mesh: DeviceMesh,
    inputs: Inputs,
) -> dict[int, BlockCall]:
    """A split Sequential's block, per size: ``block`` split with ``styles`` (path in it -> style), its
    attention's head counts set to one rank's (``heads``: path in it -> attribute -> count), called on
    the size's inputs as the stage calls it (the styles' hooks make the DTensors they need)."""
    parallelize_module(block, mesh, styles)
    for path, counts in heads.items():
        for attr, value in counts.items():
            setattr(block.get_submodule(path), attr, value)
    return {size: _called(block, args, kwargs) for size, (args, kwargs) in inputs.items()}


def graph_calls(
    block: nn.Module, styles: dict[str, ParallelStyle], mesh: DeviceMesh, inputs: Inputs
) -> tuple[dict[int, BlockCall], str]:
    """A traced stage's block, per size: ``block`` exported at the size's inputs (unflattened, one graph
    per module, as the traced source cuts its stages), then split with ``styles`` and its graphs run as
    ``split_traced`` runs a stage's: pointed at the DTensor weights ``parallelize_module`` made, their
    layouts written with ``place_split_ops``, inputs and whole weights entering as replicated DTensors
    (``TensorParallelGraph``). Where export fails, the block called eagerly on DTensors instead, and a
    note saying so."""
    try:
        programs = {size: torch.export.export(block, args, kwargs) for size, (args, kwargs) in inputs.items()}
    except Exception as err:  # export raises many types: the block is then timed as it is called
        why = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        note = f"a block timed eagerly (export failed: {why})"
        return _eager_dtensor_calls(block, styles, mesh, inputs), note
    parallelize_module(block, mesh, styles)
    # The split block's parameters by path: its DTensor weights and what stays whole.
    real = dict(block.named_parameters(remove_duplicate=False))
    calls = {}
    for size, program in programs.items():
        unflat = _generated_code(torch.export.unflatten(program))
        for path, _ in list(unflat.named_parameters(remove_duplicate=False)):
            owner, _, leaf = path.rpartition(".")
            unflat.get_submodule(owner)._parameters[leaf] = real[path]
        # The modules that run a graph, by path (as the stage view's ``graph_modules`` lists a stage's).
        graphs = [
            (n, m) for n, m in unflat.named_modules() if isinstance(getattr(m, "graph", None), fx.Graph)
        ]
        place_split_ops(graphs, styles, {})
        runs = TensorParallelGraph(_Keywords(unflat), mesh, [m for _, m in graphs])
        args, kwargs = inputs[size]
        calls[size] = lambda recomputed, r=runs, a=args, k=kwargs: r(a, k, recomputed)
    return calls, ""


def _generated_code(unflat: nn.Module) -> nn.Module:
    """``unflat``'s graphs run as generated Python code, not node by node, as the traced source runs its
    stages' (``sources/traced/trace.py``'s ``run_generated_code``, on a pipe; a technique imports no source):
    torch 2.13's private ``_run_with_interpreter`` flag of each unflattened module turned off (~1.4x
    slower with the interpreter). test_tensor_parallel_timing.py fails loudly if the flag goes."""
    for module in unflat.modules():
        if isinstance(getattr(module, "graph", None), fx.Graph):
            if not hasattr(module, "_run_with_interpreter"):
                raise RuntimeError("torch's unflattened modules lost `_run_with_interpreter` (torch 2.13)")
            module._run_with_interpreter = False
    return unflat


class _Keywords(nn.Module):
    """Calls a block's graph with its keyword inputs (``TensorParallelGraph`` passes positional ones), under
    checkpointing where ``recomputed`` (as a traced stage recomputes a unit: its graph's call wrapped)."""

    def __init__(self, graph: nn.Module) -> None:
        super().__init__()
        self.graph = graph

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], recomputed: bool) -> Any:
        if recomputed:
            return checkpoint(self.graph, *args, use_reentrant=False, **kwargs)
        return self.graph(*args, **kwargs)


def _eager_dtensor_calls(
    block: nn.Module, styles: dict[str, ParallelStyle], mesh: DeviceMesh, inputs: Inputs
) -> dict[int, BlockCall]:
    """The block called on DTensors (its styles leave their outputs DTensors, its float inputs enter
    replicated): the nearest to a traced stage's ops where its graph could not be had."""
    parallelize_module(block, mesh, {p: _dtensor_output(s) for p, s in styles.items()})
    entered = {size: tree_map(lambda t: _replicated(t, mesh), given) for size, given in inputs.items()}
    return {size: _called(block, args, kwargs) for size, (args, kwargs) in entered.items()}


def _called(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall:
    def call(recomputed: bool) -> Any:
        if recomputed:
            return checkpoint(block, *args, use_reentrant=False, **kwargs)
        return block(*args, **kwargs)

    return call


def _dtensor_output(style: ParallelStyle) -> ParallelStyle:
    """``style`` leaving its output a DTensor (the traced graphs' ops run on DTensors between the splits)."""
    style = copy.copy(style)
    if hasattr(style, "use_local_output"):
        style.use_local_output = False
    return style


def _replicated(t: Any, mesh: DeviceMesh) -> Any:
    if not torch.is_tensor(t) or not t.is_floating_point() or isinstance(t, DTensor):
        return t
    whole = DTensor.from_local(t.detach(), mesh, [Replicate()], run_check=False)
    return whole.requires_grad_(t.requires_grad)
