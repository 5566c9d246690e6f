"""The traced path: ``forward`` is traced with torch.export on a meta twin and split at the blocks.

The twin is traced as fake tensors of this rank's device (sources/fake_device.py); a failure is
checked against torch.export of the user's module before it is reported (sources/traced/errors.py). Each
export is made once for the ranks that trace together (sources/traced/share.py): global rank 0 exports for
the job at setup, a replica's first pipeline rank for its later traces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_parallel.data.batch_samples import samples_in
from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.layout.choices import placement
from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.pipeline.blocks import find_block_list
from lightning_parallel.pipeline.microbatches import first_microbatch, microbatch_count
from lightning_parallel.pipeline.partition import stage_costs
from lightning_parallel.pipeline.plan import StagePlan, describe_paths
from lightning_parallel.pipeline.proxy import CapturedInput
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.stage_source import FirstInput, UnitNaming, UnsplitModel
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.sources.materialize import materialize
from lightning_parallel.sources.profile import block_times
from lightning_parallel.sources.split_result import SplitResult
from lightning_parallel.sources.stage_plan import measured, stage_plan, units_per_stage
from lightning_parallel.sources.traced.call_binding import CallBinding, TracedCall, bound_forward
from lightning_parallel.sources.traced.errors import TraceStepFailed, explain, export_check, ours
from lightning_parallel.sources.traced.share import ProgramShare
from lightning_parallel.sources.traced.split import block_entry, block_extras, check_split_points, keep_only
from lightning_parallel.sources.traced.stage_graphs import stage_contents
from lightning_parallel.sources.traced.stages import TracedStages
from lightning_parallel.sources.traced.trace import call_order, trace
from lightning_parallel.sources.twin import alias_table, meta_twin, to_meta


class TracedSource:
    """Any other module: its ``forward`` traced with torch.export and split at its blocks (or
    ``split_points``).

    Example::

        source = TracedSource()
        split = source.build(plan, inputs, gpt, mesh, device, warn)   # this rank's stages
    """

    def unsplit(self, module: nn.Module) -> UnsplitModel:
        """``module`` before the split: its units are what its traced forward calls (export graphs)."""
        return UnsplitModel(module, module, "", graphs=True)

    def build(
        self,
        plan: ParallelPlan,
        inputs: FirstInput,
        module: nn.Module,
        mesh: PipelineMesh,
        device: torch.device,
        warn: Callable[[str], Any],
    ) -> SplitResult:
        """Trace, plan and keep this rank's tensors (every rank calls it: errors are raised by all)."""
        aliases = alias_table(module)
        num_stages = mesh.pp_size * plan.stages_per_rank
        naming = _unit_naming(module)  # (on the unsplit module)
        with failing_together():
            found = _traceable(plan, inputs, module, mesh.pp_size, num_stages, device)
        costs, unit = None, ""
        if found.blocks and plan.partition in ("parameters", "time"):
            costs, unit = _block_costs(plan, module, found)
        with failing_together():
            points, stage_cost = found.points, None
            if found.blocks:
                what = ("blocks", f"`{found.block_path}`")
                counts = units_per_stage(plan.partition, costs, len(found.blocks), num_stages, what)
                blocks = [f"{found.block_path}.{found.blocks[sum(counts[:s])]}" for s in range(1, num_stages)]
                points = [block_entry(found.order, b) for b in blocks]
                stage_cost = costs and stage_costs(costs, counts)
            if mesh.pp_size == 1 and plan.stages_per_rank > 1:
                # Adjacent stages on one rank: torch 2.13 trains them, but its evaluation step fails there
                # ("can't steal_bwd_input if this stage doesn't have backward"). The runner evaluates them
                # forward-only (VForwardOnly) as on the Sequential path, and by hand a traced TinyGPT then
                # trains and validates as on one device under the five multi-stage schedules; refused
                # until a suite test pays for a traced run of a layout that gains nothing at p=1.
                # torch workaround: no upstream issue found
                #   canary: test_torch_runs_a_forward_only_step_of_adjacent_stages_on_one_rank
                raise ValueError(
                    f"stages_per_rank={plan.stages_per_rank} on one pipeline rank is not supported for a "
                    f"traced forward: use pipeline_size >= 2 to interleave, or stages_per_rank=1"
                )
            style = placement(plan.schedule)
        # One export for every rank of the job now, one per replica later (share.py); made here, out
        # of the blocks below, since under NCCL each makes a gloo group (a collective).
        shares = ProgramShare.over(None), ProgramShare.over(mesh.pp_group)
        with failing_together():  # (the shared trace comes first: no rank can fail before it and skip it)
            stages_plan, stages = _traced_split(
                module, found, points, mesh, aliases, device, stage_cost, unit, style, warn, naming, shares
            )
        runner = PipelineRunner(stages, stages_plan.num_stages, plan.schedule, plan.num_microbatches)
        return SplitResult(stages_plan, runner, found.call, found.twin)


def _unit_naming(module: nn.Module) -> UnitNaming:
    """The traced stages call units by their paths; ``True`` recomputes the block list's blocks only."""
    try:
        path, _ = find_block_list(module)
    except ValueError:  # no block list (split_points name the stages): every unit counts
        return UnitNaming()
    return UnitNaming("", f"{path}.")


@dataclass
class _Traceable:
    """What the traced path learns before it splits: the twin, the example input, where stages may begin."""

    twin: nn.Module
    call: TracedCall
    args: tuple[Any, ...]  # the real input of self(...) on this rank's first batch
    example: tuple[Any, ...]  # its first micro-batch, on the meta device
    order: list[str]  # module paths in the order forward calls them
    points: list[str]  # user-given split points ([] when derived from the blocks)
    block_path: str = ""
    blocks: list[str] = field(default_factory=list)
    device: torch.device | None = None  # where the stages run: the twin is traced on its fakes

    @property
    def binding(self) -> CallBinding:
        return self.call.bindings[self.call.train]

    def trace(self, module: nn.Module, points: list[str], share: ProgramShare | None = None) -> Any:
        """The twin traced at ``points`` (exported once for the ranks of ``share``); a failure checked
        against torch.export of ``module`` (real), where the export ran."""
        return trace(
            self.twin, self.example, points, train=True, binding=self.binding, device=self.device,
            share=share, explain=partial(self._explain, module),
        )  # fmt: skip

    def _explain(self, module: nn.Module, failed: TraceStepFailed) -> BaseException:
        what = _what(self.call)
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            note = "the module is on the meta device: not checked against torch.export of the module"
            return explain(failed, what, note=note)
        check = partial(export_check, module, self.args, partial(bound_forward, module, self.binding))
        return explain(failed, what, check=check)


def _what(call: TracedCall) -> str:
    """``"GPT.forward"`` from the call's description (``"`self(...)` (GPT.forward)"``)."""
    found = re.search(r"\(([^()]*)\)$", call.what)
    return found.group(1) if found else "forward"


def _traceable(
    config: ParallelPlan,
    inputs: FirstInput,
    module: nn.Module,
    pp_size: int,
    num_stages: int,
    device: torch.device,
) -> _Traceable:
    _check_traceable(module)
    twin = meta_twin(module)
    call = TracedCall(f"`self(...)` ({type(module).__name__}.forward)")
    call.keyword_transform = getattr(inputs, "keywords", None)
    args = example_input(inputs, module, call, _call_paths(module, config))
    if call.path:
        call.what = f"`self.{call.path}(...)` ({type(module.get_submodule(call.path)).__name__}.forward)"
    count = microbatch_count(samples_in(args) or 1, config.num_microbatches)
    example = to_meta(first_microbatch(args, count))
    found = _Traceable(twin, call, args, example, [], [], device=device)
    found.order = order = _call_order(module, found)
    if config.split_points is not None:
        found.points = check_split_points(module, config.split_points, order, num_stages)
    elif num_stages > 1:
        found.block_path, found.blocks = find_block_list(twin)
        if num_stages > len(found.blocks):
            raise ValueError(
                f"pipeline_size x stages_per_rank ({pp_size} x {config.stages_per_rank}) is larger than the "
                f"number of blocks in `{found.block_path}` ({len(found.blocks)}): use fewer stages, or name "
                f"the stage beginnings with split_points=[...]"
            )
    return found


def _traced_split(
    module: nn.Module,
    found: _Traceable,
    points: list[str],
    mesh: PipelineMesh,
    aliases: dict[str, str],
    device: torch.device,
    costs: list[float] | None,
    unit: str,
    style: str,
    warn: Callable[[str], Any],
    naming: UnitNaming,
    shares: tuple[ProgramShare | None, ProgramShare | None] = (None, None),
) -> tuple[StagePlan, TracedStages]:
    """Trace at the split points, plan, keep this rank's tensors, and put the stand-in in ``forward``.

    ``shares``: the job's ranks, which all trace here at the same point and take one export from
    global rank 0; then the pipeline ranks of this replica, which trace again at the same points
    (a new mode or shape, in ``TracedStages``: they see the same batches) and take one export from
    the first of them.
    """
    pipe = found.trace(module, points, share=shares[0])
    contents = stage_contents(pipe)
    params = [frozenset(aliases[t] for t in c.tensors if _is_parameter(module, t)) for c in contents]
    units, holds = [c.calls for c in contents], [describe_paths(c.calls) for c in contents]
    called = found.call.path
    source = f"{type(module).__name__}.{f'{called}(...)' if called else 'forward'} (traced)"
    plan = stage_plan(module, units, holds, params, mesh.layout, costs, unit, source, style)
    indices = [s.index for s in plan.local_stages(mesh.pp_rank)]
    keep_only(module, set().union(*(contents[i].tensors for i in indices)))
    materialize(module, device, aliases)
    found.call.held = f"stages {', '.join(plan.stages[i].holds for i in indices)}"
    found.call.install(module, found.call.path)  # self(x) in the user's steps now goes through the pipeline
    stages = TracedStages(
        found.twin, points, indices, module, aliases, device, mesh.pp_group, found.call.bindings,
        warn, naming, shares[1],
    )  # fmt: skip
    if found.call.train:
        stages.keep_for_later(True, found.example, pipe)
    return plan, stages


def _call_order(module: nn.Module, found: _Traceable) -> list[str]:
    try:
        return call_order(found.twin, found.example, found.binding, found.device)
    except ValueError as err:
        # A forward that cannot run on fake tensors (a branch on a value) cannot be exported either;
        # export's own error, checked against the real module, says more about why: it goes first.
        # Each rank exports for itself: not every rank need be here (a rank whose model differs).
        found.trace(module, [])
        failed = TraceStepFailed(
            "finding the order forward calls the modules in (a run on fake tensors)", err
        )
        raise ours(failed, _what(found.call), exported=True) from err


def _call_paths(module: nn.Module, config: ParallelPlan) -> list[str]:
    """Where the user's step may call the model: ``self(...)``, or a module holding every stage's part.

    A LightningModule that holds a Hugging Face or litgpt model as ``self.model`` often calls
    ``self.model(input_ids=x)`` in its steps instead of ``self(x)``: the ancestors of the blocks (or of
    the split points) are the modules such a call may go to; the outermost one called is pipelined.
    """
    inside = list(config.split_points or [])
    if not inside:
        try:
            inside = [find_block_list(module)[0]]
        except ValueError:
            inside = []
    parents = [p.split(".")[:-1] for p in inside]
    depth = 0
    while parents and all(len(p) > depth and p[depth] == parents[0][depth] for p in parents):
        depth += 1
    paths = [".".join(parents[0][: k + 1]) for k in range(depth)] if parents else []
    lists = (nn.ModuleList, nn.ModuleDict)
    return ["", *(p for p in paths if not isinstance(module.get_submodule(p), lists))]


def _check_traceable(module: nn.Module) -> None:
    for path, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
            raise ValueError(
                f"`{path}` is a {type(sub).__name__} that updates its running statistics in forward, which "
                f"the traced split of forward cannot carry back into the module: hold the layers in a "
                f"top-level nn.Sequential (split without tracing), or use track_running_stats=False"
            )


def _is_parameter(module: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    return leaf in module.get_submodule(owner)._parameters


def _block_costs(config: ParallelPlan, module: nn.Module, found: _Traceable) -> tuple[list[float], str]:
    paths = [f"{found.block_path}.{b}" for b in found.blocks]
    if config.partition == "parameters":
        costs = [float(sum(p.numel() for p in found.twin.get_submodule(p).parameters())) for p in paths]
        before, after = block_extras(found.twin, found.order, found.block_path)
        costs[0], costs[-1] = costs[0] + before, costs[-1] + after
        return costs, "parameters"

    def measure() -> list[float]:
        if any(p.is_meta for p in module.parameters()):
            raise ValueError(
                'partition="time" times the real blocks, but the model is on the meta device: use '
                'partition="parameters" or split_points=[...] with empty_init / configure_model'
            )
        return [1000.0 * t for t in block_times(module, found.args, paths)]

    return measured(measure), "ms fwd+bwd"


def example_input(
    inputs: FirstInput, module: nn.Module, call: TracedCall, paths: Sequence[str] = ("",)
) -> tuple[Any, ...]:
    """The pipelined call's input to trace at: ``example_input_array``, else captured from the first batch.

    ``paths`` are the modules the step may call to run the model (``""``: ``self(...)``; ``"model"``:
    ``self.model(...)``, a Hugging Face model held by the LightningModule); the first one the step
    calls is the pipelined call from then on.
    """
    call.train = inputs.training
    example = inputs.example()
    if example is not None:
        return call.captured_input(CapturedInput(example))
    for path in paths:
        call.install(module, path)
    try:
        return inputs.capture(call)
    finally:
        for path in paths:
            call.uninstall(module, path)
