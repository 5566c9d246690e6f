"""Build this rank's pipeline for PipelineStrategy: the plan, the split, the runner, the shared weights.

Two ways to split, one result (:class:`PipelineParts`):

* the **Sequential path**, when the module holds its layers in one top-level ``nn.Sequential``: the
  Sequential's children are partitioned into stages (:mod:`lightning_parallel.pipeline.split`);
* the **traced path** otherwise (or with ``split_points``): ``forward`` is split with torch's tracing
  frontend on a meta twin of the module (:mod:`lightning_parallel.pipeline.trace`).

Every collective here is reached by every rank: the local work that may fail on one rank runs under
``failing_together``, so all ranks raise its error together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_parallel.distributed.agree import decide_on, failing_together
from lightning_parallel.pipeline.grads import HeldGradients
from lightning_parallel.pipeline.mesh import PipelineMesh, RankLayout, build_mesh
from lightning_parallel.pipeline.partition import (
    check_explicit,
    partition_balanced,
    partition_uniform,
    stage_costs,
)
from lightning_parallel.pipeline.plan import StagePlan, describe_paths, make_plan
from lightning_parallel.pipeline.profile import block_times, layer_times
from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.pipeline.runner import PipelineRunner, first_microbatch
from lightning_parallel.pipeline.shared import SharedReplicas, alias_table, find_shared
from lightning_parallel.pipeline.split import (
    SequentialStages,
    check_parameters_inside,
    find_sequential,
    layer_facts,
    materialize,
    split_sequential,
    stage_descriptions,
    stage_parameters,
)
from lightning_parallel.pipeline.step_logs import LogRecorder
from lightning_parallel.pipeline.trace import call_order, meta_twin, stage_contents, to_meta, trace
from lightning_parallel.pipeline.traced_split import (
    TracedStages,
    block_extras,
    check_split_points,
    find_block_list,
    keep_only,
)


@dataclass(frozen=True)
class PipelineConfig:
    """The strategy's pipeline settings, validated in ``PipelineStrategy.__init__``."""

    pipeline_size: int | None
    num_microbatches: int
    schedule: str
    stages_per_rank: int
    partition: str | list[int]
    module_name: str | None
    split_points: tuple[str, ...] | None


@dataclass
class PipelineParts:
    """This rank's pipeline: what the strategy's steps, backward and state code work with."""

    mesh: PipelineMesh
    plan: StagePlan
    runner: PipelineRunner
    call: PipelinedCall  # the stand-in the user's step calls (``self.layers(x)`` or ``self(x)``)
    shared: SharedReplicas
    param_names: dict[nn.Parameter, str]  # this rank's parameters -> canonical names
    model_keys: list[str]  # the unsplit module's state-dict keys
    model_param_order: list[str]  # the unsplit module's parameter names, in parameters() order
    twin: nn.Module | None = None  # the traced path's meta twin (precision is applied to it too)
    held: HeldGradients = field(default_factory=HeldGradients)
    predict_batches: list[int] | None = None


def build_pipeline(
    config: PipelineConfig,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    layout: RankLayout,
    device: torch.device,
) -> PipelineParts:
    """Plan and split ``module`` on this rank; every rank calls it (it creates process groups)."""
    mesh = build_mesh(device.type, layout)
    model_keys = list(module.state_dict().keys())
    model_param_order = [n for n, _ in module.named_parameters()]
    aliases = alias_table(module)
    with failing_together():
        found = find_sequential(module, config.module_name) if config.split_points is None else None
    if found is not None:
        plan, runner, call, twin = _sequential(config, trainer, module, found, mesh, device)
    else:
        plan, runner, call, twin = _traced(config, trainer, module, mesh, aliases, device)
    local = {aliases[n]: p for n, p in module.named_parameters(remove_duplicate=False)}
    shared = SharedReplicas(find_shared([s.parameters for s in plan.stages], layout.pp_size), mesh, local)
    shared.broadcast_from_owners()
    param_names = {p: aliases[n] for n, p in module.named_parameters()}
    return PipelineParts(mesh, plan, runner, call, shared, param_names, model_keys, model_param_order, twin)


# ----------------------------------------------------------------------------------- Sequential path
def _sequential(
    config: PipelineConfig,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    found: tuple[str, nn.Sequential],
    mesh: PipelineMesh,
    device: torch.device,
) -> tuple[StagePlan, PipelineRunner, PipelinedCall, None]:
    seq_name, seq = found
    num_stages = mesh.pp_size * config.stages_per_rank
    with failing_together():
        check_parameters_inside(module, seq_name)
        if num_stages > len(seq):
            raise ValueError(
                f"pipeline_size x stages_per_rank ({mesh.pp_size} x {config.stages_per_rank}) is larger than "
                f"the number of layers in `{seq_name}` ({len(seq)}): use fewer stages or split the model "
                f"into more layers"
            )
    costs, unit = None, ""
    if config.partition in ("parameters", "time"):
        costs, unit = _layer_costs(config, trainer, module, seq)
    with failing_together():
        counts = _counts(config.partition, costs, len(seq), num_stages, ("layers", "the Sequential"))
        units, holds = stage_descriptions(seq, counts)
        params = stage_parameters(module, seq_name, units)
        plan = _plan(module, units, holds, params, mesh.layout, costs and stage_costs(costs, counts), unit,
                     f"`{seq_name}` (nn.Sequential)")  # fmt: skip
        proxy, stage_modules, indices = split_sequential(module, seq_name, seq, plan, mesh.pp_rank, device)
    stages = SequentialStages(stage_modules, indices, plan.num_stages, device, mesh.pp_group)
    return (
        plan,
        PipelineRunner(stages, plan.num_stages, config.schedule, config.num_microbatches),
        proxy.call,
        None,
    )


def _layer_costs(
    config: PipelineConfig, trainer: pl.Trainer, module: pl.LightningModule, seq: nn.Sequential
) -> tuple[list[float], str]:
    if config.partition == "parameters":
        return [float(p) for p in layer_facts(seq)[2]], "parameters"

    def measure() -> list[float]:
        if any(p.is_meta for p in seq.parameters()):
            raise ValueError(
                'partition="time" times the real layers, but the model is on the meta device: use '
                'partition="parameters" or an explicit list with empty_init / configure_model'
            )
        args = _captured_input(trainer, module, _SequentialCapture(seq))
        return [1000.0 * t for t in layer_times(seq, args, next(seq.parameters()).device)]

    return _measured(measure), "ms fwd+bwd"


class _SequentialCapture:
    """Stop the user's step at its call of the Sequential (a forward pre-hook) to read that call's input."""

    def __init__(self, seq: nn.Sequential) -> None:
        self.seq = seq

    def capture(self, step: Any, *args: Any) -> tuple[Any, ...]:
        call = PipelinedCall("the pipelined Sequential")

        def stop(_mod: nn.Module, inputs: tuple[Any, ...]) -> None:
            call(*inputs)  # in capture mode: raises CapturedInput(inputs)

        handle = self.seq.register_forward_pre_hook(stop)
        try:
            return call.capture(step, *args)
        finally:
            handle.remove()


# -------------------------------------------------------------------------------------- traced path
def _traced(
    config: PipelineConfig,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    mesh: PipelineMesh,
    aliases: dict[str, str],
    device: torch.device,
) -> tuple[StagePlan, PipelineRunner, PipelinedCall, nn.Module]:
    num_stages = mesh.pp_size * config.stages_per_rank
    with failing_together():
        _check_traceable(module)
        twin = meta_twin(module)
        call = PipelinedCall(f"`self(...)` ({type(module).__name__}.forward)")
        args = _example_input(trainer, module, call)
        example = to_meta(first_microbatch(args, _microbatches(args, config.num_microbatches)))
        order = _call_order(twin, example)
        points, block_path, blocks = [], "", []
        if config.split_points is not None:
            points = check_split_points(module, config.split_points, order, num_stages)
        elif num_stages > 1:
            block_path, blocks = find_block_list(twin)
            if num_stages > len(blocks):
                raise ValueError(
                    f"pipeline_size x stages_per_rank ({mesh.pp_size} x {config.stages_per_rank}) is larger "
                    f"than the number of blocks in `{block_path}` ({len(blocks)}): use fewer stages, or name "
                    f"the stage beginnings with split_points=[...]"
                )
    costs, unit = None, ""
    if blocks and config.partition in ("parameters", "time"):
        costs, unit = _block_costs(config, module, twin, args, order, block_path, blocks)
    with failing_together():
        if blocks:
            counts = _counts(config.partition, costs, len(blocks), num_stages, ("blocks", f"`{block_path}`"))
            starts = [sum(counts[:s]) for s in range(1, num_stages)]
            points = [f"{block_path}.{blocks[i]}" for i in starts]
        if mesh.pp_size == 1 and config.stages_per_rank > 1:
            # torch 2.13's traced stages warm up their links by sending to the neighbouring stage's
            # rank, which is this rank itself here: gloo refuses that ("Pair is not connected").
            raise ValueError(
                f"stages_per_rank={config.stages_per_rank} on one pipeline rank is not supported for a "
                f"traced forward: use pipeline_size >= 2 to interleave, or stages_per_rank=1"
            )
        pipe = trace(twin, example, points, train=True)
        contents = stage_contents(pipe)
        params = [frozenset(aliases[t] for t in c.tensors if _is_parameter(module, t)) for c in contents]
        plan = _plan(module, [c.calls for c in contents], [describe_paths(c.calls) for c in contents], params,
                     mesh.layout, costs and stage_costs(costs, counts), unit,
                     f"{type(module).__name__}.forward (traced)")  # fmt: skip
        indices = [s.index for s in plan.local_stages(mesh.pp_rank)]
        keep_only(module, set().union(*(contents[i].tensors for i in indices)))
        materialize(module, device, aliases)
        call.held = f"stages {', '.join(plan.stages[i].holds for i in indices)}"
        module.forward = call  # self(x) in the user's steps now goes through the pipeline
        stages = TracedStages(twin, points, indices, module, aliases, device, mesh.pp_group)
        stages.keep_for_later(True, example, pipe)
    return plan, PipelineRunner(stages, plan.num_stages, config.schedule, config.num_microbatches), call, twin


def _call_order(twin: nn.Module, example: tuple[Any, ...]) -> list[str]:
    try:
        return call_order(twin, example)
    except ValueError:
        # A forward that cannot run on meta tensors (a branch on a value) cannot be exported either;
        # export's own error says more about why, so it goes first when there is one.
        trace(twin, example, [], train=True)
        raise


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


def _block_costs(
    config: PipelineConfig,
    module: pl.LightningModule,
    twin: nn.Module,
    args: tuple[Any, ...],
    order: Sequence[str],
    block_path: str,
    blocks: Sequence[str],
) -> tuple[list[float], str]:
    paths = [f"{block_path}.{b}" for b in blocks]
    if config.partition == "parameters":
        costs = [float(sum(p.numel() for p in twin.get_submodule(p).parameters())) for p in paths]
        before, after = block_extras(twin, order, block_path)
        costs[0], costs[-1] = costs[0] + before, costs[-1] + after
        return costs, "parameters"

    def measure() -> list[float]:
        if any(p.is_meta for p in module.parameters()):
            raise ValueError(
                'partition="time" times the real blocks, but the model is on the meta device: use '
                'partition="parameters" or split_points=[...] with empty_init / configure_model'
            )
        return [1000.0 * t for t in block_times(module, args, paths)]

    return _measured(measure), "ms fwd+bwd"


# ------------------------------------------------------------------------------------------ shared
def _counts(
    partition: str | list[int],
    costs: list[float] | None,
    num_units: int,
    num_stages: int,
    what: tuple[str, str],
) -> list[int]:
    if isinstance(partition, (list, tuple)):
        return check_explicit(partition, num_units, num_stages, *what)
    if partition == "uniform":
        return partition_uniform(num_units, num_stages)
    assert costs is not None
    return partition_balanced(costs, num_stages)


def _measured(measure: Any) -> list[float]:
    """Costs measured on global rank 0 and sent to every rank (all raise if the measurement fails)."""

    def on_rank0() -> list[float]:
        try:
            return measure()
        except Exception as err:
            raise RuntimeError(f'partition="time" could not measure the layers on rank 0: {err}') from None

    return decide_on(0, on_rank0)


def _plan(
    module: nn.Module,
    units: Sequence[Sequence[str]],
    holds: Sequence[str],
    params: Sequence[frozenset[str]],
    layout: RankLayout,
    costs: Sequence[float] | None,
    unit: str,
    source: str,
) -> StagePlan:
    sizes = {n: p.numel() for n, p in module.named_parameters()}
    shared = find_shared(params, layout.pp_size)
    notes = [
        f"{p.name} is used by stages {', '.join(map(str, p.stages))}: each of their ranks keeps a replica, "
        f"gradients summed over them"
        for p in shared
    ]
    return make_plan(
        units, holds, [sum(sizes[n] for n in ps) for ps in params], layout, costs, unit, source, params,
        {p.name: sizes[p.name] for p in shared}, notes,
    )  # fmt: skip


def _microbatches(args: tuple[Any, ...], num_microbatches: int) -> int:
    n = next(
        (int(t.shape[0]) for t in torch.utils._pytree.tree_leaves(args) if torch.is_tensor(t) and t.dim()), 1
    )
    m = min(num_microbatches, n)
    while n % m:
        m -= 1
    return m


def _example_input(trainer: pl.Trainer, module: pl.LightningModule, call: PipelinedCall) -> tuple[Any, ...]:
    """The input of ``self(...)`` to trace at: ``example_input_array``, else captured from the first batch."""
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return tuple(example) if isinstance(example, (tuple, list)) else (example,)
    module.forward = call
    try:
        return _captured_input(trainer, module, call)
    finally:
        del module.forward


def _captured_input(trainer: pl.Trainer, module: pl.LightningModule, capture: Any) -> tuple[Any, ...]:
    """Run the step of the trainer's current stage on its first batch up to the pipelined call."""
    step_name = {
        TrainerFn.FITTING: "training_step",
        TrainerFn.VALIDATING: "validation_step",
        TrainerFn.TESTING: "test_step",
        TrainerFn.PREDICTING: "predict_step",
    }[trainer.state.fn]
    batch = trainer.strategy.batch_to_device(_first_batch(trainer))
    with LogRecorder().recording(module, 1), torch.no_grad():
        return capture.capture(getattr(module, step_name), batch, 0)


def _first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the current stage's dataloader, before Lightning's loop has set it up.

    Lightning 2.6.6 keeps the user's loader in each loop's private ``_data_source``; no public
    accessor exists at strategy setup. test_pipeline_build.py fails loudly if this moves.
    """
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }[trainer.state.fn]
    loader = loop._data_source.dataloader()
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    elif isinstance(loader, dict):
        loader = next(iter(loader.values()))
    return next(iter(loader))
