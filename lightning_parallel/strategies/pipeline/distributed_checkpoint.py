"""PipelineStrategy(save_distributed_checkpoint=True): checkpoints as DCP directories.

Lightning glue over :mod:`lightning_parallel.checkpoint`. Saving: every rank hands DCP its own stage's
state (no rank gathers the model); global rank 0 writes Lightning's other state (loops, callbacks,
hyper-parameters) beside the shards as ``meta.pt``, as Lightning's ``ModelParallelStrategy`` does, and
the directory appears atomically. Loading (after the split, at any pipeline size or shard count): the
strategy's ``load_checkpoint`` returns ``meta.pt`` with the directory noted in it, and the model and
optimizer hooks then read, through DCP, only the keys this rank holds now.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from lightning_parallel.checkpoint import distributed
from lightning_parallel.checkpoint.consolidate import DCP_KEY, FORMAT, read_meta
from lightning_parallel.checkpoint.directory import verify_checkpoint_dir, write_checkpoint_dir
from lightning_parallel.checkpoint.directory_async import save_checkpoint_dir_async
from lightning_parallel.distributed.agree import agree, distributed_ready
from lightning_parallel.io.async_writer import AsyncWriter, SnapshotBuffers

if TYPE_CHECKING:
    from lightning_parallel.strategies.pipeline.build import PipelineParts

_TYPE = "optimizer_type"  # travels in the optimizer state from optimizer_state() to the save


def save_checkpoint_dir(
    parts: PipelineParts, checkpoint: dict[str, Any], path: str, tag: dict[str, Any] | None = None
) -> None:
    """Write ``checkpoint`` (from ``dump_checkpoint`` with local states) as a DCP directory: every rank."""
    state, meta, tag = dcp_parts(parts, checkpoint, path, tag)
    write_checkpoint_dir(str(path), lambda tmp: distributed.dcp.save(state, checkpoint_id=tmp), meta, tag)


def save_checkpoint_dir_in_background(
    parts: PipelineParts,
    checkpoint: dict[str, Any],
    path: str,
    tag: dict[str, Any] | None,
    writer: AsyncWriter,
    buffers: SnapshotBuffers,
) -> None:
    """:func:`save_checkpoint_dir` with the writing on ``writer``'s thread, on the checkpoint group."""
    state, meta, tag = dcp_parts(parts, checkpoint, path, tag)
    save_checkpoint_dir_async(str(path), state, meta, tag, writer, buffers)


def dcp_parts(
    parts: PipelineParts, checkpoint: dict[str, Any], path: str, tag: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the state DCP writes: model and flat optimizer states, meta.pt's content, its tag)."""
    checkpoint = dict(checkpoint)
    optimizers = [dict(flat) for flat in checkpoint.pop("optimizer_states", [])]
    types = [flat.pop(_TYPE) for flat in optimizers]
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": flat for i, flat in enumerate(optimizers)})
    checkpoint[DCP_KEY] = {
        "format": FORMAT,
        "model_param_order": parts.model_param_order,
        "optimizer_types": types,
    }
    tag = {
        "step": int(checkpoint.get("global_step", -1)),
        "epoch": int(checkpoint.get("epoch", -1)),
        **(tag or {}),
    }
    tag.setdefault("name", os.path.basename(os.path.abspath(path)))
    return state, checkpoint, tag


def local_optimizer_state(optimizer: Any, parts: PipelineParts) -> dict[str, Any]:
    """This rank's optimizer state, flat and names-keyed, with the optimizer's type (nothing gathered)."""
    flat = distributed.flat_optimizer_state(optimizer, parts.param_names)
    flat[_TYPE] = distributed.optimizer_type(optimizer)
    return flat


def load_checkpoint_meta(path: str, weights_only: bool | None) -> dict[str, Any]:
    """meta.pt of the directory, after every rank checked its share of the files' hashes.

    Any rank's error is raised on every rank."""
    error = None
    try:
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed_ready() else (0, 1)
        meta = read_meta(path, weights_only)
        result = verify_checkpoint_dir(path, rank, world)
        if not result.ok:
            error = ValueError(f"{result.describe()}: resume from another checkpoint")
    except Exception as err:
        error = err
    agree(error)
    meta[DCP_KEY]["path"] = str(path)
    meta["state_dict"] = {}  # read by load_model_state_dict, rank by rank, from the directory
    if meta[DCP_KEY]["optimizer_types"]:
        meta["optimizer_states"] = [None] * len(meta[DCP_KEY]["optimizer_types"])
    return meta


def is_directory_checkpoint(checkpoint: Any) -> bool:
    return isinstance(checkpoint, dict) and "path" in checkpoint.get(DCP_KEY, {})


def load_model(module: nn.Module, checkpoint: dict[str, Any], strict: bool) -> None:
    """Read this rank's model keys (its stage's, in their current sharding) from the directory."""
    state = {"state_dict": module.state_dict()}
    distributed.load_state(state, checkpoint[DCP_KEY]["path"], strict)
    module.load_state_dict(state["state_dict"], strict=strict)


def load_optimizers(optimizers: Sequence[Any], parts: PipelineParts, checkpoint: dict[str, Any]) -> None:
    """Read the optimizer state of this rank's parameters (its ZeRO / FSDP share) from the directory."""
    record, path = checkpoint[DCP_KEY], checkpoint[DCP_KEY]["path"]
    if len(record["optimizer_types"]) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(record['optimizer_types'])} optimizer states but "
            f"configure_optimizers "
            f"returned {len(optimizers)}: resume with the same optimizers"
        )
    for i, (opt, saved_type) in enumerate(zip(optimizers, record["optimizer_types"])):
        if distributed.optimizer_type(opt) != saved_type:
            raise ValueError(
                f"the checkpoint's optimizer {i} is {saved_type} but configure_optimizers made "
                f"{distributed.optimizer_type(opt)}: resume with the same optimizer"
            )
    saved = distributed.saved_keys(path)
    templates = {
        f"optimizer_{i}": distributed.optimizer_template(opt, parts.param_names, saved, f"optimizer_{i}")
        for i, opt in enumerate(optimizers)
    }
    distributed.load_state(templates, path)
    for i, opt in enumerate(optimizers):
        distributed.load_flat_optimizer_state(opt, parts.param_names, templates[f"optimizer_{i}"])
