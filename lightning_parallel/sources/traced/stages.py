"""The traced path's StageSource: the traced programs of this rank's stages, the torch stages built from
them per input shape.

``forward`` is traced once per mode (with dynamic sizes, so one program serves most shapes); each stage's
graph is prepared when a program is first built on this rank, and the techniques' per-stage work
(:meth:`TracedStages.each_stage`) runs on it then.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._IR import _modify_graph_op_device
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer

from lightning_parallel.pipeline.stage_source import PreparedStage, UnitNaming
from lightning_parallel.sources.stage_shapes import StageShapes
from lightning_parallel.sources.traced.call_binding import CallBinding
from lightning_parallel.sources.traced.errors import TraceStepFailed, explain, ours, step
from lightning_parallel.sources.traced.share import ProgramShare
from lightning_parallel.sources.traced.stage_graphs import graph_modules, point_at, unit_calls
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import to_meta


@dataclass
class TracedProgram:
    """One traced pipe and the stages this rank prepared of it (shared by every shape it serves)."""

    key: tuple  # (mode, parameter dtypes, way of calling)
    pipe: Any
    shapes: StageShapes
    prepared: dict[int, PreparedStage] = field(default_factory=dict)


def retrace_message(shapes: StageShapes, example: Sequence[Any]) -> str:
    """Why a traced program does not serve ``example``, and what to do about it."""
    return (
        f"PipelineStrategy: this batch's sizes are not the traced forward's ({shapes.mismatch(example)}): "
        f"it is traced again for them. torch.export fixes sizes of 1, and a model that branches on a size "
        f"fixes it or its range. Pad batches to a few lengths to bound the traces (lightning_parallel."
        f"padding_to_multiple, or a Hugging Face collator's pad_to_multiple_of)"
    )


class TracedStages:
    """This rank's traced stages: the meta twin traced once per mode, the stages built per input shape.

    ``forward`` is exported with dynamic sizes (:func:`~lightning_parallel.sources.traced.trace.trace`), so
    one trace serves every sequence length and micro-batch size the model allows; a shape it cannot
    serve (a size the model fixed, or a model that cannot be exported with dynamic sizes) is traced
    again, with one warning saying why.

    Args:
        twin: the module's meta twin (:func:`~lightning_parallel.sources.traced.trace.meta_twin`).
        split_points: module paths where stages 1.. begin.
        stage_indices: this rank's stages.
        module: the user's module, pruned to this rank's tensors (the real parameters and buffers).
        aliases: the unsplit module's alias table (name -> canonical name).
        device, group: where the stages run, and the pipeline process group.
        bindings: how the user's step calls the traced module, per mode (training: True), kept up to
            date by the stand-in (:class:`~lightning_parallel.sources.traced.call_binding.TracedCall`).
        warn: how to say that a shape is traced again (``rank_zero_warn`` in the strategy).
        share: the ranks that build the same stages at the same points (the pipeline ranks of one
            replica: they see the same batches), which then take one export from the first of them
            (:class:`~lightning_parallel.sources.traced.share.ProgramShare`); ``None``: this rank exports.

    Example::

        stages = TracedStages(meta_twin(gpt), ["h.2"], [0], gpt, alias_table(gpt), device, pp_group)
        stages.build("train", 4, example_microbatch)     # [torch PipelineStage for stage 0]
    """

    needs_example = True  # a new shape's stages are built on every rank from the call's input
    graphs = True  # each stage module is an export graph, prepared per traced program
    block_class = None  # (a stage's program is compiled whole)
    shapes_given = True  # the torch stages are given their shapes (no dummy forward at their first step)
    max_programs = 4  # traced programs kept (one serves every shape when the sizes are dynamic)

    def __init__(
        self,
        twin: nn.Module,
        split_points: Sequence[str],
        stage_indices: Sequence[int],
        module: nn.Module,
        aliases: Mapping[str, str],
        device: torch.device,
        group: Any,
        bindings: Mapping[bool, CallBinding] | None = None,
        warn: Callable[[str], Any] = warnings.warn,
        naming: UnitNaming | None = None,
        share: ProgramShare | None = None,
    ) -> None:
        self.naming = naming or UnitNaming()
        self.twin, self.split_points = twin, list(split_points)
        self.share = share
        self.bindings = bindings if bindings is not None else {}
        self.stage_indices, self.module, self.aliases = list(stage_indices), module, dict(aliases)
        # What holds this rank's tensors for the whole fit (the graphs read them): the pruned module, or
        # the wrapper a technique puts in its place.
        self.modules: list[nn.Module] = [module]
        self.device, self.group = device, group
        self.num_stages = len(self.split_points) + 1
        self._on_stage: list[Callable[[PreparedStage], Any]] = []  # each_stage(), in the order given
        self.traces = 0  # how many times forward was traced, the one for planning included (tests read it)
        self._output_ndims: tuple[bool, list[int]] | None = None  # (a tuple?, ndim of each output)
        self._programs: list[TracedProgram] = []  # least recently used first
        self._merge_weights: Sequence[float] | None = None  # set for one forward-only step (merging)
        self.warn = warn
        self._warned: set[str] = set()
        self._stage_cls: type[PipelineStage] = PipelineStage  # use_stage_class()
        # torch stage -> what runs before a schedule of it steps (PreparedStage.activate): dropped with it
        self._activations: weakref.WeakKeyDictionary[Any, Callable[[], Any]] = weakref.WeakKeyDictionary()

    # --- the StageSource interface (pipeline/stage_source.py)
    def each_stage(self, fn: Callable[[PreparedStage], Any]) -> None:
        """Call ``fn`` on each stage prepared so far, and on each stage prepared later (its module is the
        traced program's, prepared at the program's first build on this rank)."""
        self._on_stage.append(fn)
        for program in self._programs:
            for stage in program.prepared.values():
                fn(stage)

    def use_stage_class(self, cls: type[PipelineStage]) -> None:
        self._stage_cls = cls

    @contextlib.contextmanager
    def merging(self, weights: Sequence[float] | None) -> Iterator[None]:
        """What each micro-batch's scalar outputs count for while a forward-only step merges them."""
        self._merge_weights = weights
        try:
            yield
        finally:
            self._merge_weights = None

    def keep_for_later(self, train: bool, example: tuple[Any, ...], pipe: Any) -> None:
        """Serve the shapes ``pipe`` (traced for planning, at ``example``) serves: no trace again for them."""
        self._programs.append(self._program(train, example, pipe))
        self.traces += 1

    # torch workaround: no upstream issue found
    #   canary: test_torch_stages_infer_their_shapes_without_running_on_uninitialised_inputs
    def build(self, mode: str, num_microbatches: int, example: tuple[Any, ...] | None) -> list[Any]:
        """This rank's torch stages for micro-batches shaped as ``example``: milliseconds, once traced.

        A traced program (one per mode, way of calling and parameter dtypes) serves every shape its
        dynamic sizes cover; the stages' send and receive shapes for this one are evaluated from it.

        The stages are torch's manual ``PipelineStage`` (the frontend every schedule accepts): torch's
        traced stages (``Pipe.build_stage``) refuse DTensor parameters and fail the V-shaped schedules'
        P2P warm-up (ZBV, DualPipeV: "Pair is not connected"). After ``relay_skips`` a stage reads only
        its neighbour's outputs, in their order, which is what a manual stage sends and receives. Its
        shapes are given (static mode): a manual stage left to infer them runs its forward once on
        uninitialised buffers, which a stage that indexes with a received tensor (a loss computed from
        relayed labels) cannot survive.
        """
        example = to_meta(example)
        program = self._program_for(mode == "train", example)
        examples = program.shapes.examples(example)
        stages = []
        for index in self.stage_indices:
            prepared = self._prepared(program, index)
            inputs, outputs = examples[index]
            stage = self._stage_cls(
                prepared.module if prepared.runs is None else prepared.runs, index, self.num_stages,
                self.device, input_args=inputs, output_args=outputs, group=self.group,
            )  # fmt: skip
            if prepared.activate is not None:
                self._activations[stage] = prepared.activate
            stages.append(stage)
        if self.num_stages - 1 in self.stage_indices:
            self._output_ndims = _output_ndims(program.pipe.get_stage_module(self.num_stages - 1))
        return stages

    def _program_for(self, train: bool, example: tuple[Any, ...]) -> TracedProgram:
        """The traced program that serves ``example``, most recently used first; traced if none does."""
        key = self._key(train)
        same_call = [p for p in self._programs if p.key == key]
        for program in reversed(same_call):
            if program.shapes.serves(example):
                self._programs.remove(program)
                self._programs.append(program)
                return program
        pipe = self._trace(train, example)
        self.traces += 1
        program = self._program(train, example, pipe)
        if same_call:
            self._warn_once("retrace", retrace_message(same_call[-1].shapes, example))
        self._programs.append(program)
        if len(self._programs) > self.max_programs:
            self._programs.pop(0)
        return program

    def _trace(self, train: bool, example: tuple[Any, ...]) -> Any:
        """Trace again for a shape no program serves (one export for the ranks of ``share``); a failure
        says whose it is (sources/traced/errors.py)."""
        shapes = [tuple(t.shape) for t in example if torch.is_tensor(t)]
        note = (
            f"traced again for inputs of shapes {shapes}; not checked against the module itself, "
            f"which this rank holds only its stages of"
        )
        return trace(
            self.twin, example, self.split_points, train, self.bindings.get(train), device=self.device,
            share=self.share, explain=partial(explain, what=self._what, note=note),
        )  # fmt: skip

    @property
    def _what(self) -> str:
        return f"{type(self.twin).__name__}.forward"

    def _program(self, train: bool, example: tuple[Any, ...], pipe: Any) -> TracedProgram:
        if pipe.num_stages != self.num_stages:
            raise RuntimeError(
                f"tracing at a new input shape gave {pipe.num_stages} stages instead of {self.num_stages}: "
                f"forward calls other modules at this shape"
            )
        if getattr(pipe, "dynamic_failure", None):
            self._warn_once(
                "static",
                f"PipelineStrategy: forward could not be exported with dynamic sizes "
                f"({pipe.dynamic_failure}); each new input shape is traced again. Pad batches to a few "
                f"lengths to bound the traces (lightning_parallel.padding_to_multiple, or a Hugging Face "
                f"collator's pad_to_multiple_of)",
            )
        with _building("sizing the stages' inputs and outputs on fake tensors", self._what):
            shapes = StageShapes(pipe, example, train, self.device)
        return TracedProgram(self._key(train), pipe, shapes)

    def _key(self, train: bool) -> tuple:
        binding = self.bindings.get(train)
        dtypes = tuple(t.dtype for t in self.twin.parameters())
        return (train, dtypes, binding.key if binding is not None else None)

    def _prepared(self, program: TracedProgram, index: int) -> PreparedStage:
        """Stage ``index`` of ``program`` made ready to run on this rank, once.

        Its graph is pointed at this rank's real tensors and devices, then the techniques' per-stage
        work runs on it (:meth:`each_stage`: tensor-parallel layouts written into it, its units wrapped
        for recomputation, compiled in place, ...); the torch stages of every input shape then share it.
        """
        if index in program.prepared:
            return program.prepared[index]
        stage_module = program.pipe.get_stage_module(index)
        with _building(f"building stage {index} around this rank's tensors", self._what):
            point_at(stage_module, _real_tensors(self.module, self.aliases), self.aliases)
            # The tracer recorded devices in the graph (``torch.ones(..., device=cuda:0)``): moved to
            # the stage's device as ``Pipe.build_stage`` does, with the same private helper (torch 2.13).
            _modify_graph_op_device(stage_module, self.device)
        units = self.naming.named(called_units(stage_module))
        stage = program.prepared[index] = PreparedStage(
            index, stage_module, units, graph_modules(stage_module)
        )
        for fn in self._on_stage:
            fn(stage)
        return stage

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            self.warn(message)

    def activate(self, stages: Sequence[Any]) -> None:
        """Before a schedule steps: what its stages' techniques set to run then (a root that runs every
        stage's graph told which one: each schedule's shapes have their program)."""
        for stage in stages:
            activation = self._activations.get(stage)
            if activation is not None:
                activation()

    def output_merge_spec(self, num_microbatches: int) -> Any:
        """How the last stage's micro-batch outputs merge into the batch's (None: concatenated on dim 0).

        A scalar output (the loss a Hugging Face model computes from ``labels=``) cannot be concatenated:
        it is the mean of the micro-batches' values, weighted by ``merge_weights`` when the step sets
        them (their labelled tokens: the batch's token mean), else equally. torch's merge takes a private
        ``_CustomReducer`` for that (checked against torch 2.13), fed the micro-batches in order.
        """
        ndims = self._output_ndims
        if ndims is None or all(d != 0 for d in ndims[1]):
            return None
        specs = tuple(TensorChunkSpec(0) if d != 0 else self._scalar_mean(num_microbatches) for d in ndims[1])
        return specs if ndims[0] else specs[0]

    def _scalar_mean(self, num_microbatches: int) -> _CustomReducer:
        index = itertools.count()

        def add(total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            i = next(index) % num_microbatches
            weights = self._merge_weights or [1.0] * num_microbatches
            share = weights[i] / sum(weights) if sum(weights) else 0.0
            return total + value * share if share else total + torch.zeros_like(value)

        return _CustomReducer(torch.tensor(0.0), add)


@contextlib.contextmanager
def _building(name: str, what: str) -> Iterator[None]:
    """A failure of this package's own stage building, reported as such (sources/traced/errors.py)."""
    try:
        with step(name):
            yield
    except TraceStepFailed as failed:
        raise ours(failed, what, exported=True) from failed.error


def called_units(stage_module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules a traced stage's graph calls, by their paths in the user's module ("h.2")."""
    return unit_calls(stage_module)


def _output_ndims(stage_module: nn.Module) -> tuple[bool, list[int]]:
    """Whether a stage returns a tuple, and the number of dimensions of each output (-1: unknown)."""
    output = next(n for n in stage_module.graph.nodes if n.op == "output").args[0]
    values = list(output) if isinstance(output, (tuple, list)) else [output]
    vals = [getattr(v, "meta", {}).get("val") for v in values]
    ndims = [v.dim() if torch.is_tensor(v) else -1 for v in vals]
    return isinstance(output, (tuple, list)), ndims


def _real_tensors(module: nn.Module, aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {aliases.get(name, name): t for name, t in named}
