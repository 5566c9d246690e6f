"""The traced path: split a module's ``forward`` with torch's tracing frontend (``pipeline()``, torch.export).

For models that are not one ``nn.Sequential`` (nanoGPT, litgpt, Hugging Face decoders: embeddings, a
ModuleList of blocks, a head, maybe tied to the embedding). Tracing runs on a *meta twin* of the module
(same structure and ties, parameters on the meta device), so it costs no memory, leaves the user's
module untouched, and can be repeated for each new input shape. While it is traced, the twin's tensors
and the example's are fake tensors of the device the stages run on
(:mod:`~lightning_parallel.pipeline.fake_device`): a forward that branches on its inputs' device, or
enters ``torch.autocast(x.device.type, ...)``, is traced on the path that device takes. The stage
modules it yields are then pointed at this rank's real tensors and wrapped in torch's pipeline stages.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import types
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import Pipe, pipe_split
from torch.distributed.pipelining._IR import MultiUseParameterConfig
from torch.export import Dim
from torch.export.unflatten import InterpreterModule

from lightning_parallel.pipeline.call_binding import CallBinding, bound_forward
from lightning_parallel.pipeline.fake_device import FakeDevice, faked_on, trace_device
from lightning_parallel.pipeline.graph_regions import inline_wrapped_regions
from lightning_parallel.pipeline.relay import relay_skips
from lightning_parallel.pipeline.stage_shapes import keeping_rng
from lightning_parallel.pipeline.symbolic_sizes import SizeConstraints, localize_sizes
from lightning_parallel.pipeline.trace_errors import (
    EXPORT,
    PipelineTraceError,  # noqa: F401  (re-exported from its old home)
    TraceStepFailed,
    step,
)


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


def call_order(
    module: nn.Module,
    args: tuple[Any, ...],
    binding: CallBinding | None = None,
    device: torch.device | str | None = None,
) -> list[str]:
    """Module paths in the order ``module(*args)`` first calls them (run on a meta twin: free).

    The twin runs on fake tensors of ``device`` (default: the CPU), the stages' device.

    Raises:
        ValueError: the forward fails on these inputs (a batch the model rejects).
    """
    order: dict[str, None] = {}
    device = trace_device(device)
    handles = [
        sub.register_forward_pre_hook(lambda _m, _a, path=path: order.setdefault(path))
        for path, sub in module.named_modules()
        if path
    ]
    try:
        # Fake tensors, not bare meta ones: libraries that branch on a tensor's value unless they are
        # being traced (transformers' mask code calls .item() otherwise) see fake tensors as tracing.
        with faked_on(module, device) as fake, _bound(module, binding), torch.no_grad():
            inputs = fake.inputs(args)
            with fake.mode:
                module(*inputs)
    except Exception as err:
        shapes = [tuple(a.shape) for a in args if torch.is_tensor(a)]
        raise ValueError(
            f"{type(module).__name__}.forward failed on inputs of shapes {shapes} (run on fake "
            f"{device} tensors to find the stages): {type(err).__name__}: {err}"
        ) from err
    finally:
        for h in handles:
            h.remove()
    return list(order)


def trace(
    twin: nn.Module,
    example: tuple[Any, ...],
    split_points: Sequence[str],
    train: bool,
    binding: CallBinding | None = None,
    dynamic: bool = True,
    device: torch.device | str | None = None,
) -> Pipe:
    """``torch.distributed.pipelining.pipeline`` on the twin, split before each of ``split_points``.

    The twin and ``example`` are traced as fake tensors of ``device`` (default: the CPU), the device
    the stages will run on; the pipe's stage modules hold the twin's meta tensors again.

    With ``dynamic`` (the default) every dimension of every input is exported as ``Dim.AUTO``: the
    program keeps a size symbolic wherever the model lets it (the batch and sequence lengths of a
    transformer), so one trace serves every such shape; where the model fixes a size (its width),
    export specialises it. Where export fails with dynamic dimensions but not without, the pipe is
    the static one and ``pipe.dynamic_failure`` says why (else it is ``None``). The sizes the program
    holds for are ``pipe.size_constraints`` (:class:`~lightning_parallel.pipeline.symbolic_sizes.
    SizeConstraints`).

    A split point is marked by a forward pre-hook, removed afterwards, so the twin can be traced
    again at another shape.

    Raises:
        TraceStepFailed: a step failed (:mod:`~lightning_parallel.pipeline.trace_errors` says whose
            failure it is: the forward's, or this package's).
    """
    twin.train(train)
    # Each stage begins with torch's pipe_split marker, recorded by a pre-hook of the module where it
    # begins (torch's annotate_split_points patches the module's forward instead, which makes export
    # record the module's children by relative paths: x-transformers' blocks then cannot be cut).
    hooks = [twin.get_submodule(p).register_forward_pre_hook(_split_before) for p in split_points]
    try:
        with warnings.catch_warnings():
            # torch 2.13's export warns about its own pytree internals on every trace: not the user's concern.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            with _bound(twin, binding), keeping_rng():
                pipe = _pipeline(twin, example, split_points, dynamic, device)
    finally:
        for hook in hooks:
            hook.remove()
    with step("relaying values read past the next stage"):
        relay_skips(pipe)  # a value made before the blocks and read by every block reaches the later stages
    return run_generated_code(pipe)


def _split_before(_module: nn.Module, _args: Any) -> None:
    pipe_split()


def _bound(module: nn.Module, binding: CallBinding | None) -> Any:
    return bound_forward(module, binding) if binding is not None else contextlib.nullcontext()


def _pipeline(
    twin: nn.Module,
    example: tuple[Any, ...],
    split_points: Sequence[str],
    dynamic: bool,
    device: torch.device | str | None,
) -> Pipe:
    """torch's ``pipeline(twin, example, split_spec)``, exported with dynamic sizes, regions inlined.

    ``pipeline()`` is ``torch.export`` (with static shapes only) followed by ``Pipe._from_traced``,
    which cuts the exported program; the export is made here (:func:`export_for_pipeline`, on fake
    tensors of ``device``) and handed to that step (private, torch 2.13; test_trace.py fails loudly if
    it moves). The split points are marked with torch's ``pipe_split()`` (see :func:`trace`), and the
    split policy, the hook where the graph can be changed before the cut, inlines the no-grad
    regions (:mod:`~lightning_parallel.pipeline.graph_regions`, for pytorch#184361) and makes every
    stage compute the sizes it uses (:mod:`~lightning_parallel.pipeline.symbolic_sizes`).
    """
    with faked_on(twin, device) as fake:
        try:
            program, failure = export_for_pipeline(twin, fake.inputs(example), dynamic)
        except RuntimeError as err:
            raise TraceStepFailed(EXPORT, err.__cause__ or err) from err
        _hold_originals(program, fake)
    with step(f"splitting the exported graph into stages at {list(split_points)}"):
        pipe = Pipe._from_traced(twin, program, MultiUseParameterConfig.REPLICATE, split_policy=_before_split)
    pipe.dynamic_failure = failure
    pipe.size_constraints = SizeConstraints.of(program)  # (the stage graphs no longer hold them)
    return pipe


def _hold_originals(program: torch.export.ExportedProgram, fake: FakeDevice) -> None:
    """Point the program's parameters, buffers and constants back at the twin's meta tensors.

    Export keeps the module's tensors it read (here the fakes of :func:`faked_on`); the stages cut
    from it then hold tensors that allocate nothing and belong to no fake mode, as before the trace.
    """
    for table in (program.state_dict, program.constants):
        for name, value in list(table.items()):
            table[name] = fake.original(value)


def export_for_pipeline(
    module: nn.Module, example: tuple[Any, ...], dynamic: bool = True
) -> tuple[torch.export.ExportedProgram, str | None]:
    """``torch.export`` of ``module(*example)``, with dynamic sizes if ``dynamic``.

    Every input dimension is ``Dim.AUTO`` (dynamic where the model lets it, specialised where it
    does not), except the micro-batch dimension (dim 0 of every input, one size): tried first as a
    ``Dim`` from 1, so a micro-batch of one sample (a short last batch) is served too, which
    ``Dim.AUTO`` never allows (it specialises sizes of 0 and 1). Returns the program and, when no
    dynamic export succeeded and a static one was made instead, the first line of export's reason
    (``None`` otherwise).

    Raises:
        RuntimeError: export failed (its error is the ``__cause__``), as ``pipeline()`` raises it.
    """
    failure = None
    for batch in (Dim("microbatch", min=1), Dim.AUTO) if dynamic else ():
        try:
            fresh = _fresh(example)
            return torch.export.export(module, fresh, dynamic_shapes=_dims(module, fresh, batch)), None
        except Exception as err:  # export raises many types; the next attempt says whether it is the shape
            failure = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    try:
        return torch.export.export(module, _fresh(example)), failure
    except Exception as err:
        raise RuntimeError("torch.export could not capture the module's forward as one graph") from err


def _fresh(example: tuple[Any, ...]) -> tuple[Any, ...]:
    """New tensor objects for one export attempt: a failed export leaves its dimension markers on its
    inputs (``_dynamo_dynamic_indices``), which would make the next attempt's sizes what the last asked."""
    return tuple(t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in example)


def _dims(module: nn.Module, example: tuple[Any, ...], batch: Any) -> tuple[Any, ...]:
    specs = tuple(
        {d: batch if d == 0 else Dim.AUTO for d in range(t.dim())} if torch.is_tensor(t) and t.dim() else None
        for t in example
    )
    params = list(inspect.signature(module.forward).parameters.values())
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return (specs,)  # forward(*tensors) (a bound call): one spec, a tuple, for the varargs
    return specs


def _before_split(gm: fx.GraphModule) -> fx.GraphModule:
    return localize_sizes(device_args_as_keywords(inline_wrapped_regions(gm)))


def device_args_as_keywords(gm: fx.GraphModule) -> fx.GraphModule:
    """Pass every device given positionally to an aten op (``aten.to.device(x, cpu, ...)``) by keyword.

    ``x.to(h.device)`` records the traced device as a positional argument; torch's ``build_stage``
    moves a stage's ops to its device by rewriting their ``device=`` keyword only
    (``_modify_graph_op_device``), which a positional device escapes. The stages are traced for the
    device they run on, so the two agree; a stage moved to another device (a traced program reused
    after ``model.to(...)``) still runs every op there.
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        first = next((i for i, a in enumerate(node.args) if isinstance(a, torch.device)), None)
        if first is None:
            continue
        names = [a.name for a in node.target._schema.arguments]
        moved = {names[i]: a for i, a in enumerate(node.args) if i >= first}
        node.args, node.kwargs = node.args[:first], {**moved, **node.kwargs}
        changed = True
    if changed:
        gm.recompile()
    return gm


def run_generated_code(pipe: Pipe) -> Pipe:
    """Make the traced stage modules run their graphs as generated Python code, not node by node.

    torch 2.13's unflattener builds ``InterpreterModule``s that execute their graph with
    ``torch.fx.Interpreter`` (one Python dispatch per node) unless their private
    ``_run_with_interpreter`` flag is off; off, they run the ``GraphModule`` code generated from the
    same graph: the same ops, without the per-node overhead (the traced GPT's steps measured ~1.4x
    slower with the interpreter in ``bench_gpt_pipeline.py``). test_trace.py fails loudly if the flag goes.
    """
    for module in pipe.split_gm.modules():
        if isinstance(module, InterpreterModule):
            if not hasattr(module, "_run_with_interpreter"):
                raise RuntimeError("torch's InterpreterModule lost `_run_with_interpreter` (checked on 2.13)")
            module._run_with_interpreter = False
    return pipe


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
