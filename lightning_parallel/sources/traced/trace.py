"""The traced path: split a module's ``forward`` with torch's tracing frontend (``pipeline()``, torch.export).

For models that are not one ``nn.Sequential`` (nanoGPT, litgpt, Hugging Face decoders: embeddings, a
ModuleList of blocks, a head, maybe tied to the embedding). Tracing runs on a *meta twin* of the module
(same structure and ties, parameters on the meta device), so it costs no memory, leaves the user's
module untouched, and can be repeated for each new input shape. While it is traced, the twin's tensors
and the example's are fake tensors of the device the stages run on
(:mod:`~lightning_parallel.sources.fake_device`): a forward that branches on its inputs' device, or
enters ``torch.autocast(x.device.type, ...)``, is traced on the path that device takes. The stage
modules it yields are then pointed at this rank's real tensors and wrapped in torch's pipeline stages.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import Pipe, pipe_split
from torch.distributed.pipelining._IR import MultiUseParameterConfig
from torch.export.unflatten import InterpreterModule

from lightning_parallel.sources.export import export_for_pipeline
from lightning_parallel.sources.fake_device import FakeDevice, faked_on, trace_device
from lightning_parallel.sources.stage_shapes import keeping_rng
from lightning_parallel.sources.symbolic_sizes import SizeConstraints, localize_sizes
from lightning_parallel.sources.traced.call_binding import CallBinding, bound_forward
from lightning_parallel.sources.traced.errors import (
    EXPORT,
    TraceStepFailed,
    step,
)
from lightning_parallel.sources.traced.graph_regions import inline_wrapped_regions
from lightning_parallel.sources.traced.relay import relay_skips
from lightning_parallel.sources.traced.share import Exported, ProgramShare, exported_locally


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
    share: ProgramShare | None = None,
    explain: Callable[[TraceStepFailed], BaseException] | None = None,
) -> Pipe:
    """``torch.distributed.pipelining.pipeline`` on the twin, split before each of ``split_points``.

    The twin and ``example`` are traced as fake tensors of ``device`` (default: the CPU), the device
    the stages will run on; the pipe's stage modules hold the twin's meta tensors again.

    With ``dynamic`` (the default) every dimension of every input is exported as ``Dim.AUTO``: the
    program keeps a size symbolic wherever the model lets it (the batch and sequence lengths of a
    transformer), so one trace serves every such shape; where the model fixes a size (its width),
    export specialises it. Where export fails with dynamic dimensions but not without, the pipe is
    the static one and ``pipe.dynamic_failure`` says why (else it is ``None``). The sizes the program
    holds for are ``pipe.size_constraints`` (:class:`~lightning_parallel.sources.symbolic_sizes.
    SizeConstraints`).

    A split point is marked by a forward pre-hook, removed afterwards, so the twin can be traced
    again at another shape.

    With ``share`` (:class:`~lightning_parallel.sources.traced.share.ProgramShare`, a collective: every rank
    of its group calls ``trace`` at the same point with the same arguments), one rank exports and the
    others cut their stages from its program: the same pipe as their own export would give.

    Raises:
        TraceStepFailed: a step failed (:mod:`~lightning_parallel.sources.traced.errors` says whose
            failure it is: the forward's, or this package's); with ``explain``, ``explain(failed)``
            is raised instead, made where the step failed (the export's on the exporting rank, and
            raised on every rank).
    """
    try:
        return _trace(twin, example, split_points, train, binding, dynamic, device, share, explain)
    except TraceStepFailed as failed:
        if explain is None:
            raise
        raise explain(failed) from failed.error


def _trace(
    twin: nn.Module,
    example: tuple[Any, ...],
    split_points: Sequence[str],
    train: bool,
    binding: CallBinding | None,
    dynamic: bool,
    device: torch.device | str | None,
    share: ProgramShare | None,
    explain: Callable[[TraceStepFailed], BaseException] | None,
) -> Pipe:
    twin.train(train)
    # Each stage begins with torch's pipe_split marker, recorded by a pre-hook of the module where it
    # begins (torch's annotate_split_points patches the module's forward instead, which makes export
    # record the module's children by relative paths: x-transformers' blocks then cannot be cut).
    hooks = [twin.get_submodule(p).register_forward_pre_hook(_split_before) for p in split_points]
    try:
        with warnings.catch_warnings():
            # torch 2.13's pipeline frontend warns about its own pytree internals on every trace: not the
            # user's concern. torch workaround: no upstream issue found
            #   canary: test_torch_pipeline_warns_nothing_about_its_own_pytree_internals
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            with _bound(twin, binding), keeping_rng():
                exported = _exported(
                    twin, example, split_points, train, binding, dynamic, device, share, explain
                )
                pipe = _pipeline(twin, exported.program, exported.failure, split_points)
    finally:
        for hook in hooks:
            hook.remove()
    with step("relaying values read past the next stage"):
        relay_skips(pipe)  # a value made before the blocks and read by every block reaches the later stages
    return run_generated_code(pipe)


def _exported(
    twin: nn.Module,
    example: tuple[Any, ...],
    split_points: Sequence[str],
    train: bool,
    binding: CallBinding | None,
    dynamic: bool,
    device: torch.device | str | None,
    share: ProgramShare | None,
    explain: Callable[[TraceStepFailed], BaseException] | None,
) -> Exported:
    """This rank's export of the twin, or the one ``share`` hands every rank of its group.

    Running forward, the export also learns the structure of the call's output (``binding.out_spec``,
    a ``ModelOutput``...): it travels with the program, and is set on ``binding`` on every rank.
    """

    def export() -> Exported:
        program, failure = _export(twin, example, dynamic, device, explain)
        return Exported(program, failure, binding.out_spec if binding is not None else None)

    if share is None:
        exported = exported_locally(export)
    else:
        settings = {
            "mode": "train" if train else "eval",
            "split points": list(split_points),
            "call": binding.key if binding is not None else None,
            "dynamic": dynamic,
        }
        exported = share.exported(export, twin, example, settings, device)
    if binding is not None:
        binding.out_spec = exported.out_spec
    return exported


def _split_before(_module: nn.Module, _args: Any) -> None:
    pipe_split()


def _bound(module: nn.Module, binding: CallBinding | None) -> Any:
    return bound_forward(module, binding) if binding is not None else contextlib.nullcontext()


def _export(
    twin: nn.Module,
    example: tuple[Any, ...],
    dynamic: bool,
    device: torch.device | str | None,
    explain: Callable[[TraceStepFailed], BaseException] | None,
) -> tuple[torch.export.ExportedProgram, str | None]:
    """The twin's forward exported with dynamic sizes (:func:`export_for_pipeline`, on fake tensors of
    ``device``), holding the twin's meta tensors; and why it is static, or ``None``.

    ``pipeline()`` is ``torch.export`` (with static shapes only) followed by ``Pipe._from_traced``: the
    export is made here, the cut in :func:`_pipeline`. A failure is explained here, where the export
    ran (a shared export's error then travels to every rank as it is).
    """
    with faked_on(twin, device) as fake:
        try:
            program, failure = export_for_pipeline(twin, fake.inputs(example), dynamic)
        except RuntimeError as err:
            failed = TraceStepFailed(EXPORT, err.__cause__ or err)
            if explain is None:
                raise failed from err
            raise explain(failed) from err
        _hold_originals(program, fake)
    return program, failure


def _pipeline(
    twin: nn.Module,
    program: torch.export.ExportedProgram,
    failure: str | None,
    split_points: Sequence[str],
) -> Pipe:
    """The exported ``program`` cut into stages with torch's ``Pipe._from_traced``, regions inlined.

    The cut is the second half of ``pipeline()``, handed the export of :func:`_export` (private, torch
    2.13; test_trace.py fails loudly if it moves). The split points are marked with torch's
    ``pipe_split()`` (see :func:`trace`), and the split policy, the hook where the graph can be changed
    before the cut, inlines the no-grad regions (:mod:`~lightning_parallel.sources.traced.graph_regions`, for
    pytorch#184361) and makes every stage compute the sizes it uses
    (:mod:`~lightning_parallel.sources.symbolic_sizes`).
    """
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


def _before_split(gm: fx.GraphModule) -> fx.GraphModule:
    return localize_sizes(device_args_as_keywords(inline_wrapped_regions(gm)))


# torch workaround: no upstream issue found
#   canary: test_torch_moves_a_positional_device_of_a_stage_graph
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
