"""Consolidated checkpoints of a split module: merge the stages' state on global rank 0, reshard on load.

Lightning glue over :mod:`lightning_parallel.pipeline.state`: the strategy's state-dict hooks call
these. Saving is a collective over each replica's pipeline (replica 0's stages send their parts to
global rank 0); loading is local (each rank takes its stage's keys and optimizer state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_parallel.distributed.agree import distributed_ready
from lightning_parallel.distributed.collectives import gather_object_to
from lightning_parallel.distributed.dtensors import distribute_like, full_tensors
from lightning_parallel.optim.sharded import consolidate
from lightning_parallel.pipeline import state as stage_state

if TYPE_CHECKING:
    from lightning_parallel.strategies.pipeline.build import PipelineParts


def consolidated_state_dict(module: nn.Module, parts: PipelineParts | None) -> dict[str, Any]:
    """The unsplit module's state dict on global rank 0 (``{}`` on the other ranks of a pipeline)."""
    local = module.state_dict()
    if parts is not None and (parts.sharded or parts.mesh.tp_size > 1):
        # FSDP2 / tensor-parallel stages: every data-parallel and tensor-parallel rank joins the gathers.
        local = full_tensors(local)
    if parts is not None and parts.mesh.tp_rank != 0:
        return {}
    if parts is None or parts.mesh.pp_size == 1 or not distributed_ready():
        return local
    if parts.mesh.rank("gradients") != 0:  # (another copy of this stage: the ranks averaging its gradients)
        return {}
    gathered = gather_object_to(stage_state.to_cpu(dict(local)), 0, parts.mesh.pp_group)
    if gathered is None:
        return {}
    # A key every stage holds (a torchmetrics Metric's persistent state) is taken from the last stage's
    # rank, where the step updates it; the stages' own keys are disjoint (tied replicas are equal).
    last = parts.plan.pp_rank_of(parts.plan.num_stages - 1)
    parts_in_order = [*gathered[:last], *gathered[last + 1 :], gathered[last]]
    merged = {k: v for part in parts_in_order for k, v in part.items()}
    return {k: merged[k] for k in parts.model_keys if k in merged}


def consolidated_optimizer_state(
    optimizer: torch.optim.Optimizer, parts: PipelineParts | None
) -> dict[str, Any]:
    """The unsplit model's optimizer state on global rank 0, in single-device layout with param names."""
    if parts is None:
        return optimizer.state_dict()
    consolidate(optimizer)  # a sharded (ZeRO) optimizer gathers on replica 0: every replica calls it
    copy = parts.mesh.rank("gradients")  # (0: the copy of this stage that saves it)
    if copy != 0 and not parts.sharded:
        return {}
    # FSDP2 / tensor-parallel stages: every rank of each DTensor's mesh joins the all-gathers of its state.
    named = stage_state.named_optimizer_state(optimizer, parts.param_names, full_tensors)
    if copy != 0 or parts.mesh.tp_rank != 0:
        return {}
    gathered = gather_object_to(named, 0, parts.mesh.pp_group)
    if gathered is None:
        return {}
    return stage_state.merge_optimizer_states(gathered, parts.model_param_order)


def load_stage_state(
    module: nn.Module, parts: PipelineParts | None, full: Mapping[str, Any], strict: bool = True
) -> None:
    """Load this rank's keys of a consolidated (or single-device) state dict into its stage."""
    if strict and parts is not None:
        stage_state.check_keys(parts.model_keys, full, type(module).__name__)
    local = module.state_dict()
    # A sharded (FSDP2) stage takes its slice of each full tensor, as the tensor it replaces is placed.
    mine = {k: distribute_like(v, local[k]) for k, v in full.items() if k in local}
    module.load_state_dict(mine, strict=strict)


def load_stage_optimizer_states(
    optimizers: Sequence[torch.optim.Optimizer], parts: PipelineParts | None, states: Sequence[dict]
) -> None:
    """Give each optimizer this rank's slice of the checkpoint's consolidated optimizer state."""
    if len(states) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(states)} optimizer states but configure_optimizers returned "
            f"{len(optimizers)}: resume with the same optimizers"
        )
    assert parts is not None
    for optimizer, full in zip(optimizers, states):
        local = stage_state.reshard_optimizer_state(
            full, optimizer, parts.param_names, parts.model_param_order
        )
        optimizer.load_state_dict(_placed_like_parameters(local, optimizer))


def _placed_like_parameters(local: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Each parameter's full state tensors as DTensors placed as the (FSDP2-sharded) parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {i: {k: distribute_like(v, params[i]) for k, v in s.items()} for i, s in local["state"].items()}
    return {**local, "state": state}
