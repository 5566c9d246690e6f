"""The mechanics of sharding a rank's stages with FSDP2 and reducing their gradients once per optimizer step.

Apart from the technique (``technique.py``: when to shard, what to refuse) because this is what runs:
``fully_shard`` on each block of a stage module (a child that holds parameters), then on the stage root,
as torchtitan does, with ``reshard_after_forward=False`` (under a pipeline a stage runs forward once per
micro-batch: resharding after each would all-gather again for every micro-batch); a traced stage is one
root instead (``traced.py``).

Gradients are reduce-scattered once per optimizer step: :class:`DeferredReduceStage` ends each
``schedule.step()`` without reducing (FSDP accumulates the unsharded gradients), and
:func:`reduce_gradients`, called once before the optimizer steps (:class:`ReduceScatter`, the technique's
reduction), reduce-scatters the whole accumulation window's gradients. FSDP divides by the data-parallel
size: a mean over the replicas, as the all-reduce of plain replicas does.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.pipeline.stage_source import StageSource
from lightning_parallel.techniques.fsdp._internals import finish_backward
from lightning_parallel.techniques.fsdp.traced import shard_traced
from lightning_parallel.techniques.job import Reduction


def apply(stages: StageSource, plan: Any, mesh: Any, pin_memory: bool = False) -> list[nn.Module]:
    """Shard this rank's stages (the stage view's ``modules``) with FSDP2 when the plan says
    ``data_parallel="fsdp"`` (their shards on the host with ``offload="parameters"``, page-locked with
    ``pin_memory``): each stage module, or traced stages' one root (:func:`shard_traced`). The modules
    that are FSDP roots (also those a user's ``parallelize_fn`` made roots), whose gradients are then
    reduced once per optimizer step (:class:`DeferredReduceStage`).

    Raises:
        ValueError: FSDP2 without a process group (no device mesh).

    Example::

        roots = fsdp.apply(runner.stages, plan, mesh)
    """
    if plan.data_parallel == "fsdp" and mesh.device_mesh is None:
        raise ValueError(
            'data_parallel="fsdp" needs a process group (a device mesh) and there is none: run '
            'under a Trainer with the pipeline strategy, or use data_parallel="replicate"'
        )
    sharding = plan.data_parallel == "fsdp"
    # FSDP2's offload (offload="parameters"): the shards, their gradients and the optimizer state on the host.
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if sharding and "parameters" in plan.offload else None
    if sharding:
        quiet_view_output_warning()
    if sharding and stages.graphs:
        shard_traced(stages, mesh.data_parallel_mesh(), policy)
    elif sharding:
        for module in stages.modules:
            if not isinstance(module, FSDPModule):  # (a user-sharded one is left to it)
                shard_stage(module, mesh.data_parallel_mesh(), offload_policy=policy)
    roots = sharded_roots(stages.modules)
    if roots:
        stages.use_stage_class(DeferredReduceStage)
    return roots


def shard_stage(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = False,
    offload_policy: OffloadPolicy | None = None,
) -> FSDPModule:
    """``fully_shard`` each block of ``module`` (its children with parameters), then ``module`` itself.

    Children that share a parameter with another child are left to the root (FSDP2 cannot shard one
    parameter in two modules). A 2-D ``mesh`` (replicate, shard) gives HSDP. ``offload_policy``:
    FSDP2's ``CPUOffloadPolicy`` keeps the shards, their gradients and the optimizer state on the host.

    Example::

        shard_stage(stage_module, mesh.device_mesh["dp_shard"])
        isinstance(stage_module, FSDPModule)      # True; its parameters are DTensors
    """
    blocks = [c for c in module.children() if any(True for _ in c.parameters())]
    owners: dict[int, int] = {}
    for block in blocks:
        for p in block.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    kwargs["offload_policy"] = offload_policy or OffloadPolicy()
    for block in blocks:
        if all(owners[id(p)] == 1 for p in block.parameters()):
            fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module  # type: ignore[return-value]


def sharded_roots(modules: Iterable[nn.Module]) -> list[FSDPModule]:
    """The stage modules that are FSDP roots (by this package or by a user's ``parallelize_fn``)."""
    return [m for m in modules if isinstance(m, FSDPModule)]


def reduce_gradients(roots: Iterable[FSDPModule]) -> None:
    """Reduce-scatter the gradients accumulated since the last call: once per optimizer step."""
    for root in roots:
        finish_backward(root, reduce=True)


def reshard(roots: Iterable[FSDPModule]) -> None:
    """Free the unsharded parameters (after a forward-only step; training steps reshard themselves).

    ``FSDPModule.reshard`` frees its own parameters only: every FSDP module under each root is asked.
    """
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


# torch workaround: https://github.com/pytorch/pytorch/pull/196641
#   canary: test_torch_schedules_keep_an_fsdp_module_s_gradient_sync_off
class DeferredReduceStage(PipelineStage):
    """A ``PipelineStage`` whose ``schedule.step()`` ends FSDP's backward without reducing gradients.

    torch 2.13 reduce-scatters at the end of every ``step()``; Lightning may accumulate several
    steps before the optimizer steps, so the reduction waits for :func:`reduce_gradients`.
    ``scale_grads`` stays the schedule's business (the strategy passes ``scale_grads=False``).
    """

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # Forward-only schedules call it too: nothing to end there (evaluation reshards by itself).
        if isinstance(self.submod, FSDPModule) and self.has_backward:
            finish_backward(self.submod, reduce=False)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


class ReduceScatter(Reduction):
    """The FSDP2 roots' gradients reduce-scattered once per optimizer step (the whole window's), before
    the tied weights' replicas sum their shards.

    Example::

        ReduceScatter(roots)(finished=())
    """

    before_tied_sum = True

    def __init__(self, roots: Sequence[FSDPModule]) -> None:
        self.roots = list(roots)
        self.params = [p for root in self.roots for p in root.parameters()]

    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        reduce_gradients(self.roots)


VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"
"""The start of the warning torch 2.13's FSDP2 gives for every forward whose output is a view."""


def quiet_view_output_warning() -> None:
    """Filter FSDP2's view-output warning (:data:`VIEW_OUTPUT_WARNING`) in this process: harmless here.

    FSDP2 warns at every forward whose output is a view, because an in-place op on that view would
    drop the pre-backward hook that all-gathers the parameters again for backward. An ``nn.Linear`` on
    a 3-D input returns a view (its matmul's output reshaped), so a language model's last stage warns
    twice on every rank that holds it (the head, and the stage module that returns its output) whether
    or not anything writes to it. Under this package the hook has nothing to do: the stages are sharded
    with ``reshard_after_forward=False``, so their parameters stay gathered from the first forward to
    the end of backward, and the end of each step's backward is driven by :class:`DeferredReduceStage`
    and :func:`reduce_gradients`, not by the hook. Training with in-place ops on the head's output
    equals one device (``tests/test_pipeline_fsdp.py``, the ``gpt-hsdp-1x2x2-inplace``
    run). The filter is the process's: it is set only where the package itself shards the stages
    (``data_parallel="fsdp"``), not for a module a user's ``parallelize_fn`` shards.

    Example::

        quiet_view_output_warning()   # before the stages first run forward; adding it again adds nothing
    """
    warnings.filterwarnings("ignore", message=VIEW_OUTPUT_WARNING, category=UserWarning)
