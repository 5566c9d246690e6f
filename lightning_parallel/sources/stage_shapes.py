"""What each traced stage sends and receives, for any input its traced program serves, without running it.

torch's manual ``PipelineStage`` is given the shapes of its inputs and outputs for one micro-batch
(static mode: no metadata exchange, no dummy forward). A program traced with dynamic dimensions has
symbolic shapes in its graphs (``(s0, s1, 32)``); :class:`StageShapes` reads them once, and for each
new input (another sequence length, a short last batch) evaluates them with the input's sizes: a few
hundred microseconds for any depth, where running the stages on fake tensors costs a few milliseconds
per block. What autograd tracks (``requires_grad``) and the dtypes are read once, from one run on
fake tensors at the traced shape, since export's values do not record them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import Pipe

from lightning_parallel.sources.fake_device import faked_on, trace_device
from lightning_parallel.sources.symbolic_sizes import (
    SizeConstraints,
    evaluate_shape,
    evaluate_stride,
    symbol_values,
)

StageExample = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]  # (inputs, outputs), meta tensors


class StageShapes:
    """The stages' input and output tensors (as meta tensors) of a traced pipe, for any served input.

    Args:
        pipe: the traced pipe (its stage graphs carry the traced values, symbolic where dynamic).
        example: the input it was traced at (meta tensors), run once on fake tensors.
        train: the mode of the schedules it serves (what autograd tracks differs).
        device: the device the stages run on (their fake tensors', default: the CPU).

    Example::

        shapes = StageShapes(pipe, example, train=True)
        shapes.serves(new_example)                 # False: a static dimension differs
        inputs, outputs = shapes.examples(new_example)[1]   # stage 1's, with the new sizes
    """

    def __init__(
        self, pipe: Pipe, example: tuple[Any, ...], train: bool, device: torch.device | str | None = None
    ) -> None:
        self.num_stages = pipe.num_stages
        self.constraints = getattr(pipe, "size_constraints", None) or SizeConstraints()
        self._fake = stage_examples(pipe, example, train, device)
        self._traced = [_traced_values(pipe.get_stage_module(i)) for i in range(pipe.num_stages)]
        self.symbolic = all(
            len(vals) == len(fake) and all(torch.is_tensor(v) for v in vals)
            for (ins, outs), (fake_in, fake_out) in zip(self._traced, self._fake)
            for vals, fake in ((ins, fake_in), (outs, fake_out))
        )

    @property
    def dynamic_dims(self) -> list[list[int]]:
        """For each input of the traced call, the dimensions the program leaves free."""
        if not self.symbolic:
            return [[] for _ in self._fake[0][0]]
        return [[d for d, s in enumerate(t.shape) if isinstance(s, torch.SymInt)] for t in self._traced[0][0]]

    def traced_shape(self, index: int) -> tuple[int, ...]:
        """The shape input ``index`` of the traced call had when it was traced."""
        return tuple(self._fake[0][0][index].shape)

    def serves(self, example: Sequence[Any]) -> bool:
        """Whether the traced program runs this input: static sizes agree, dynamic ones are in range."""
        return self._values(example) is not None

    def mismatch(self, example: Sequence[Any]) -> str:
        """Why the program does not serve ``example``: the sizes that differ or fall outside its range."""
        tensors = [t for t in example if torch.is_tensor(t)]
        found = []
        for i, (traced, real) in enumerate(zip(self._traced[0][0], tensors)):
            shape = traced.shape if self.symbolic else self._fake[0][0][i].shape
            if len(shape) != real.dim():
                found.append(f"input {i} has {real.dim()} dimensions, traced with {len(shape)}")
                continue
            for d, (t, r) in enumerate(zip(shape, real.shape)):
                if not isinstance(t, torch.SymInt) and int(t) != r:
                    found.append(f"input {i} dim {d}: {int(t)} -> {r}")
                elif isinstance(t, torch.SymInt) and not self.constraints.allow({t.node.expr: int(r)}):
                    found.append(
                        f"input {i} dim {d}: {r}, outside the traced range {self.constraints.range(t)}"
                    )
        return "; ".join(found) or "the sizes break a relation the trace assumed between them"

    def examples(self, example: Sequence[Any]) -> list[StageExample]:
        """Each stage's inputs and outputs for one micro-batch ``example`` (meta tensors).

        Raises:
            ValueError: the traced program does not serve this input (see :meth:`serves`).
        """
        values = self._values(example)
        if values is None:
            raise ValueError("internal error: these stage shapes were traced for another input shape")
        return [
            (self._metas(ins, fake_in, values), self._metas(outs, fake_out, values))
            for (ins, outs), (fake_in, fake_out) in zip(self._traced, self._fake)
        ]

    def _values(self, example: Sequence[Any]) -> dict[Any, int] | None:
        tensors = [t for t in example if torch.is_tensor(t)]
        if not self.symbolic:
            same = [tuple(t.shape) for t in tensors] == [tuple(f.shape) for f in self._fake[0][0]]
            return {} if same else None
        try:
            values = symbol_values([t.shape for t in self._traced[0][0]], [t.shape for t in tensors])
        except ValueError:
            return None
        return values if self.constraints.allow(values) else None

    def _metas(self, traced: Sequence[Any], fake: Sequence[torch.Tensor], values: dict[Any, int]) -> tuple:
        if not self.symbolic:  # (a static trace: its one shape)
            return tuple(_meta(tuple(f.shape), f.stride(), f) for f in fake)
        return tuple(
            _meta(shape := evaluate_shape(t.shape, values), evaluate_stride(shape, t.stride(), values), f)
            for t, f in zip(traced, fake)
        )


class ChainedShapes:
    """The shapes of a chain of separately exported stages (a split Sequential), for any served input.

    Each stage twin is exported once with dynamic sizes; for a new input the sizes are bound stage by
    stage (stage ``k``'s inputs are stage ``k - 1``'s evaluated outputs) and every stage's constraints
    checked. Dtypes and ``requires_grad`` come from one run on fake tensors (``fake``) at a traced shape.

    Example::

        shapes = ChainedShapes.export(stage_twins, fake_examples, True, export_for_pipeline)
        shapes.examples(new_example)    # each stage's (inputs, outputs), or None if not served
    """

    def __init__(
        self, programs: Sequence[torch.export.ExportedProgram], fake: Sequence[StageExample]
    ) -> None:
        self._stages = [(_user_values(p), SizeConstraints.of(p)) for p in programs]
        self._fake = list(fake)

    @classmethod
    def export(
        cls,
        stage_modules: Sequence[torch.nn.Module],
        fake: Sequence[StageExample],
        train: bool,
        export: Callable[[torch.nn.Module, tuple[Any, ...]], tuple[torch.export.ExportedProgram, Any]],
    ) -> ChainedShapes:
        """``export`` each stage module (with dynamic sizes) on meta inputs shaped as its ``fake`` inputs.

        Raises:
            Exception: what export raises for a module it cannot capture.
        """
        programs = []
        for module, (inputs, _) in zip(stage_modules, fake):
            module.train(train)
            example = tuple(meta_like(t).detach() for t in inputs)
            with keeping_rng(), torch.set_grad_enabled(train):
                programs.append(export(module, example)[0])
        return cls(programs, fake)

    def examples(self, example: Sequence[Any]) -> list[StageExample] | None:
        shapes = [tuple(t.shape) for t in example if torch.is_tensor(t)]
        out = []
        for ((ins, outs), constraints), (fake_in, fake_out) in zip(self._stages, self._fake):
            try:
                values = symbol_values([t.shape for t in ins], shapes)
            except ValueError:
                return None
            if not constraints.allow(values):
                return None
            made_in = tuple(_meta(s, _contiguous(s), f) for s, f in zip(shapes, fake_in))
            made_out = tuple(
                _meta(shape := evaluate_shape(t.shape, values), evaluate_stride(shape, t.stride(), values), f)
                for t, f in zip(outs, fake_out)
            )
            out.append((made_in, made_out))
            shapes = [tuple(t.shape) for t in made_out]
        return out


def _user_values(program: torch.export.ExportedProgram) -> tuple[list[Any], list[Any]]:
    """The traced values of a program's user inputs and outputs (its parameters and buffers left out)."""
    signature = program.graph_signature
    nodes = {n.name: n for n in program.graph.nodes}
    inputs = [nodes[name].meta["val"] for name in signature.user_inputs]
    output = next(n for n in program.graph.nodes if n.op == "output").args[0]
    outputs = [o.meta["val"] for o in output[: len(signature.user_outputs)]]
    return inputs, outputs


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def stage_examples(
    pipe: Pipe, example: tuple[Any, ...], train: bool, device: torch.device | str | None = None
) -> list[StageExample]:
    """Each stage's inputs and outputs for one micro-batch, as fake tensors: the stages' static metadata.

    The stages are run in turn on fake tensors of ``device`` (free; default: the CPU), in the mode of
    the schedule, so each tensor knows whether autograd tracks it: a stage receives its gradient only
    for those outputs, which the graph's own fake values do not say (export records no
    ``requires_grad``). Run before the stage modules are pointed at real tensors.
    """
    modules = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    return run_on_fake(modules, example, train, trace_device(device))


def run_on_fake(
    stage_modules: Sequence[torch.nn.Module],
    example: Sequence[Any],
    train: bool,
    device: torch.device | None = None,
) -> list[StageExample]:
    """Run ``stage_modules`` in turn on fake tensors of ``example``: each one's (inputs, outputs).

    Nothing is allocated and the random number generators are left as they were. With ``device``,
    each module's (meta) parameters and buffers, and the example's tensors, take part as fake tensors
    on that device (:mod:`~lightning_parallel.sources.fake_device`): every branch on a device and
    every autocast region (``torch.autocast("cpu")`` casts no meta tensor) takes the path the real
    stage will take. Without it, the tensors take part on the devices they are on.
    """
    out = []
    with keeping_rng(), torch.set_grad_enabled(train), contextlib.ExitStack() as stack:
        if device is None:
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            args = tuple(mode.from_tensor(a) if torch.is_tensor(a) else a for a in example)
        else:
            fake = stack.enter_context(faked_on(stage_modules, device))
            args = tuple(fake.inputs(tuple(example)))
            stack.enter_context(fake.mode)
        for stage_module in stage_modules:
            outputs = stage_module(*args)
            outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
            out.append((args, outputs))
            args = outputs
    return out


def keeping_rng() -> Any:
    """Restore the CPU's and the current accelerator's random state on exit (as torch's schedules do
    around their own shape inference)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.random.fork_rng(devices=[torch.cuda.current_device()])
    return torch.random.fork_rng(devices=[])


def _traced_values(stage_module: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The traced values of a stage graph's placeholders and outputs (``None`` where none was recorded)."""
    graph = stage_module.graph
    inputs = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    result = next(n for n in graph.nodes if n.op == "output").args[0]
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    return inputs, [getattr(o, "meta", {}).get("val") for o in outputs]


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """An empty meta tensor with ``t``'s shape, strides, dtype and ``requires_grad``."""
    return _meta(tuple(t.shape), t.stride(), t)


def _meta(shape: tuple[int, ...], stride: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(shape, stride, dtype=like.dtype, device="meta")
    return meta.requires_grad_(like.requires_grad)
