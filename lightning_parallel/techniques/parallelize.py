"""Parallelize each stage module after the split: tensor parallelism, ``parallelize_fn``, compile, FSDP2.

torchtitan's order: whatever changes a stage's computation (tensor parallelism, a user's own
wrapping; recomputation is installed before) first, then ``torch.compile`` of the blocks, then
data-parallel sharding over the stage's data-parallel ranks (FSDP2 on top of
tensor-parallel DTensors is 2-D: each rank holds a data-parallel shard of its tensor-parallel slice).
Plain replicas and
ZeRO-1 leave the stage modules as they are (their gradients are averaged by the strategy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.plan.checks import CompileOptions
from lightning_parallel.techniques.compile import compile_in_place
from lightning_parallel.techniques.fsdp import shard_stage
from lightning_parallel.techniques.tensor_parallel.apply import apply_plan
from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan

ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module | None]


def parallelize_stages(
    modules: Sequence[nn.Module],
    device_mesh: DeviceMesh | None,
    shard_mesh: DeviceMesh | None,
    data_parallel: str = "replicate",
    parallelize_fn: ParallelizeFn | None = None,
    tensor_plan: TensorPlan | None = None,
    child_names: Sequence[Sequence[str]] = (),
    compile_options: CompileOptions | None = None,
    block_type: type | None = None,
) -> list[FSDPModule]:
    """Split each stage module's layers over the ``"tp"`` mesh dimension, run ``parallelize_fn``, compile
    the blocks, then FSDP2.

    Args:
        modules: this rank's stage modules (changed in place).
        device_mesh: the whole mesh (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``), as the user's
            function receives it.
        shard_mesh: the data-parallel mesh a stage is sharded on (``dp_shard`` or, for HSDP,
            ``(dp_replicate, dp_shard)``).
        data_parallel: one of :data:`~lightning_parallel.plan.choices.DATA_PARALLEL`; ``"fsdp"``
            shards every stage that the user's function did not already make an FSDP root.
        parallelize_fn: changes the stage module in place and returns it (or None).
        tensor_plan: the tensor-parallel plan (:mod:`~lightning_parallel.techniques.tensor_parallel.plan`),
            applied on ``device_mesh["tp"]``; ``child_names[i]``: the module paths of ``modules[i]``'s
            children.
        compile_options: ``torch.compile``'s keywords for the blocks (None: none compiled); each child
            of class ``block_type`` (every child if None) is compiled in place
            (:mod:`~lightning_parallel.techniques.compile`).

    Returns:
        The stage modules that are FSDP roots (their gradients are FSDP's to reduce).

    Raises:
        TypeError: ``parallelize_fn`` returned another module.
        ValueError: ``"fsdp"`` without a device mesh (one process without a process group).

    Example::

        roots = parallelize_stages(stage_modules, mesh.device_mesh, mesh.data_parallel_mesh(), "fsdp")
    """
    if tensor_plan is not None:
        if device_mesh is None:
            raise ValueError("tensor parallelism needs a process group (a device mesh) and there is none")
        apply_plan(list(modules), [list(n) for n in child_names], tensor_plan, device_mesh["tp"])
    for module in modules:
        if parallelize_fn is not None:
            returned = parallelize_fn(module, device_mesh)
            if returned is not None and returned is not module:
                raise TypeError(
                    f"parallelize_fn returned a new {type(returned).__name__}: it must change the stage "
                    f"module it receives in place (fully_shard, parallelize_module, ...) and return it "
                    f"or None"
                )
        if compile_options is not None:
            children = list(module.named_children())
            blocks = [(n, c) for n, c in children if block_type is None or type(c) is block_type]
            compile_in_place(blocks, compile_options)
        if data_parallel == "fsdp" and not isinstance(module, FSDPModule):
            if shard_mesh is None:
                raise ValueError(
                    'data_parallel="fsdp" needs a process group (a device mesh) and there is none: run '
                    'under a Trainer with the pipeline strategy, or use data_parallel="replicate"'
                )
            shard_stage(module, shard_mesh)
    return [m for m in modules if isinstance(m, FSDPModule)]
