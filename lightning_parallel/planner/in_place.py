"""The techniques' own measurements on the job: what their time effects read instead of a formula.

After the model's units are timed (on every rank at once), every rank builds the same
:class:`~lightning_parallel.techniques.ledgers.TimeBench` (the job's ranks and device, the model's layout,
a block and the smallest unit with the inputs the probe recorded, the tensor-parallel plans the strategy
would split it with) and calls each technique's ``measure`` in the list's order (FSDP2: a block under
``fully_shard`` on the job's group; tensor parallelism: a block split over real DTensors). What each
returns goes into every measured size's ``TimeFacts.measured`` under the technique's name, where its
``time`` reads it. A measurement that fails on any rank is left out on every rank (the technique's time
falls back on the links), with a note saying why.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel.distributed.agree import agree, distributed_ready, world_size
from lightning_parallel.planner.facts import ModelFacts, planned_tensors
from lightning_parallel.planner.optimizer_time import optimizer_factory
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.ledgers import TimeBench
from lightning_parallel.techniques.tensor_parallel.traced import register_missing_shardings


def measure_in_place(
    module: nn.Module,
    facts: Mapping[int, ModelFacts],
    device: torch.device,
    repeats: int = 3,
    optimizers: list[torch.optim.Optimizer] | None = None,
) -> list[str]:
    """Every technique's measurement on the job, put in each of ``facts``' times (every rank calls it, after
    timing the units); lines saying what was measured and what was left out, for the log.

    Example::

        facts = measure_for(model, batch, search, optimizer, sync=dist.barrier)   # on every rank
        notes = measure_in_place(model, facts, torch.device("cuda", rank))
    """
    base = facts.get(1) or next(iter(facts.values()))
    if base.times is None or world_size() < 2:
        return []
    bench = TimeBench(
        ranks=world_size(), device=device, layout=base.layout.kind, samples=base.times.samples,
        sizes=base.times.sizes, tensor_plans={tp: planned_tensors(module, tp) for tp in facts if tp > 1},
        repeats=repeats, sync=_barrier, mesh=_Meshes(device.type), dtensor_rules=register_missing_shardings,
        optimizer=optimizer_factory(optimizers or []),
    )  # fmt: skip
    measured, notes = {}, []
    for technique in TECHNIQUES:
        result, error = None, None
        try:
            result = technique.measure(bench)
        except Exception as err:
            error = err
        try:
            agree(error)
        except Exception as err:
            why = f"{type(err).__name__}: {err}".splitlines()[0]
            notes.append(f"{technique.name} not measured in place ({why}): its time from the links")
            continue
        if result is not None:
            measured[technique.name] = result
            said = getattr(result, "note", "")  # how it ran, where not as the run will (TensorParallelTimes)
            notes.append(f"{technique.name} measured in place" + (f" ({said})" if said else ""))
    for f in facts.values():
        if f.times is not None:
            f.times.measured.update(measured)
    return notes


class _Meshes:
    """``mesh(shape, names)``: a device mesh of the job's ranks, built once per shape (a collective)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._built: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}

    def __call__(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        key = (tuple(shape), tuple(names))
        if key not in self._built:
            self._built[key] = init_device_mesh(self.device_type, key[0], mesh_dim_names=key[1])
        return self._built[key]


def _barrier() -> None:
    if distributed_ready():
        dist.barrier()


__all__ = ["measure_in_place"]
