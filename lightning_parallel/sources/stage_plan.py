"""Stage boundaries from layer (or block) costs, and the stage plan with its notes on shared weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_parallel.distributed.agree import decide_on
from lightning_parallel.grads.tied import find_shared
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.pipeline.partition import check_explicit, partition_balanced, partition_uniform
from lightning_parallel.pipeline.plan import StagePlan, make_plan, shard_bytes


def units_per_stage(
    partition: str | list[int],
    costs: list[float] | None,
    num_units: int,
    num_stages: int,
    what: tuple[str, str],
) -> list[int]:
    """How many layers (or blocks) each stage gets: ``what`` names them in errors, e.g. ("blocks", "`h`")."""
    if isinstance(partition, (list, tuple)):
        return check_explicit(partition, num_units, num_stages, *what)
    if partition == "uniform":
        return partition_uniform(num_units, num_stages)
    assert costs is not None
    return partition_balanced(costs, num_stages)


def measured(measure: Any) -> list[float]:
    """Costs measured on global rank 0 and sent to every rank (all raise if the measurement fails)."""

    def on_rank0() -> list[float]:
        try:
            return measure()
        except Exception as err:
            raise RuntimeError(f'partition="time" could not measure the layers on rank 0: {err}') from None

    return decide_on(0, on_rank0)


def stage_plan(
    module: nn.Module,
    units: Sequence[Sequence[str]],
    holds: Sequence[str],
    params: Sequence[frozenset[str]],
    layout: RankLayout,
    costs: Sequence[float] | None,
    unit: str,
    source: str,
    style: str = "loop",
) -> StagePlan:
    """The plan of stages given what each runs and the canonical parameters each uses (ties noted).

    ``style`` places the stages on the ranks (``"v"`` for ZBV and DualPipeV, see ``stage_rank``).
    """
    sizes = {n: p.numel() for n, p in module.named_parameters()}
    shared = find_shared(params, layout.pp_size, style)
    notes = [
        f"{p.name} is used by stages {', '.join(map(str, p.stages))}: each of their ranks keeps a replica, "
        f"gradients summed over them"
        for p in shared
    ]
    per_rank = None
    if layout.dp_shard_size > 1:  # FSDP2: what each of a stage's ranks keeps of its parameters
        # (over the shard role: the data-parallel shards x the sequence-parallel ranks, which join it)
        shards = {
            n: shard_bytes(p.shape, p.element_size(), layout.size("shard"))
            for n, p in module.named_parameters()
        }
        per_rank = [sum(shards[n] for n in ps) for ps in params]
    return make_plan(
        units, holds, [sum(sizes[n] for n in ps) for ps in params], layout, costs, unit, source, params,
        {p.name: sizes[p.name] for p in shared}, notes, per_rank, style,
    )  # fmt: skip
