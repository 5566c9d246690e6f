"""Parallelize each stage module after the split: the user's ``parallelize_fn``, then data parallelism.

torchtitan's order: whatever changes a stage's computation (tensor parallelism, a user's own
wrapping) first, then data-parallel sharding over the stage's data-parallel ranks. Plain replicas and
ZeRO-1 leave the stage modules as they are (their gradients are averaged by the strategy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.parallelize.fsdp import shard_stage

DATA_PARALLEL = ("replicate", "zero1", "fsdp")

ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module | None]


def parallelize_stages(
    modules: Sequence[nn.Module],
    device_mesh: DeviceMesh | None,
    shard_mesh: DeviceMesh | None,
    data_parallel: str = "replicate",
    parallelize_fn: ParallelizeFn | None = None,
) -> list[FSDPModule]:
    """Apply ``parallelize_fn(stage_module, device_mesh)`` to each stage module, then FSDP2 if asked.

    Args:
        modules: this rank's stage modules (changed in place).
        device_mesh: the whole mesh (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``), as the user's
            function receives it.
        shard_mesh: the data-parallel mesh a stage is sharded on (``dp_shard`` or, for HSDP,
            ``(dp_replicate, dp_shard)``).
        data_parallel: one of :data:`DATA_PARALLEL`; ``"fsdp"`` shards every stage that the user's
            function did not already make an FSDP root.
        parallelize_fn: changes the stage module in place and returns it (or None).

    Returns:
        The stage modules that are FSDP roots (their gradients are FSDP's to reduce).

    Raises:
        TypeError: ``parallelize_fn`` returned another module.
        ValueError: ``"fsdp"`` without a device mesh (one process without a process group).

    Example::

        roots = parallelize_stages(stage_modules, mesh.device_mesh, mesh.data_parallel_mesh(), "fsdp")
    """
    for module in modules:
        if parallelize_fn is not None:
            returned = parallelize_fn(module, device_mesh)
            if returned is not None and returned is not module:
                raise TypeError(
                    f"parallelize_fn returned a new {type(returned).__name__}: it must change the stage "
                    f"module it receives in place (fully_shard, parallelize_module, ...) and return it "
                    f"or None"
                )
        if data_parallel == "fsdp" and not isinstance(module, FSDPModule):
            if shard_mesh is None:
                raise ValueError(
                    'data_parallel="fsdp" needs a process group (a device mesh) and there is none: run '
                    'under a Trainer with the pipeline strategy, or use data_parallel="replicate"'
                )
            shard_stage(module, shard_mesh)
    return [m for m in modules if isinstance(m, FSDPModule)]
