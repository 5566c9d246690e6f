"""Which strategies give global rank 0 the whole checkpoint, so that Rank0Checkpoint may write it alone.

``trainer._checkpoint_connector.dump_checkpoint`` asks the strategy for the module and optimizer
state. Most strategies give rank 0 all of it (DDP, single device, PipelineStrategy, FSDP with
``state_dict_type="full"``). Sharded ones give each rank only its own part and write a directory
through every rank (``strategy.save_checkpoint``); one file from rank 0 would then be a partial
checkpoint. Those are refused at setup, naming the alternative; a sharded tensor met at save time
(a strategy not listed here) is refused too, naming its key.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_parallel.io.async_writer import AsyncWriter, SnapshotBuffers
from lightning_parallel.strategies.pipeline.distributed_checkpoint import (
    save_checkpoint_dir,
    save_checkpoint_dir_in_background,
)
from lightning_parallel.strategies.pipeline.strategy import PipelineStrategy

_SHARDED_TENSOR_TYPES = ("DTensor", "ShardedTensor")


def sharded_strategy_problem(strategy: pl.strategies.Strategy) -> str | None:
    """Why rank 0 would not hold the whole checkpoint under ``strategy``, and what to use instead; or None.

    Reads ``FSDPStrategy._state_dict_type`` and ``ModelParallelStrategy._save_distributed_checkpoint``,
    private attributes of Lightning 2.6.6 (:func:`check_strategy_internals` fails loudly if they move).
    """
    name = type(strategy).__name__
    if isinstance(strategy, FSDPStrategy) and getattr(strategy, "_state_dict_type", None) == "sharded":
        return (
            f"{name}(state_dict_type='sharded') gives each rank only its shard of the state. Use "
            f"{name}(state_dict_type='full') to write one consolidated file from global rank 0, or "
            "Lightning's ModelCheckpoint, which saves the sharded directory through the strategy"
        )
    if isinstance(strategy, DeepSpeedStrategy):
        return (
            f"{name} keeps the optimizer (and with ZeRO-3 the parameter) state partitioned and saves it "
            "through the DeepSpeed engine on every rank. Use Lightning's ModelCheckpoint, which saves "
            "through the strategy"
        )
    distributed = getattr(strategy, "_save_distributed_checkpoint", True)
    if isinstance(strategy, ModelParallelStrategy) and distributed:
        return (
            f"{name}(save_distributed_checkpoint=True) gives each rank only its shard of the state. Use "
            f"{name}(save_distributed_checkpoint=False) to write one consolidated file from global rank 0, "
            "or Lightning's ModelCheckpoint, which saves the sharded directory through the strategy"
        )
    return None


def writes_directories(strategy: pl.strategies.Strategy) -> bool:
    """Whether ``strategy`` saves a distributed checkpoint directory that Rank0Checkpoint can publish."""
    return isinstance(strategy, PipelineStrategy) and strategy.parallel_plan.save_distributed_checkpoint


def save_directory(
    strategy: PipelineStrategy, checkpoint: dict[str, Any], path: str, tag: dict[str, Any]
) -> None:
    """Every rank: write ``checkpoint`` as the strategy's distributed checkpoint directory, atomically."""
    save_checkpoint_dir(strategy.parts, checkpoint, path, tag)


def save_directory_in_background(
    strategy: PipelineStrategy,
    checkpoint: dict[str, Any],
    path: str,
    tag: dict[str, Any],
    writer: AsyncWriter,
    buffers: SnapshotBuffers,
) -> None:
    """Every rank: :func:`save_directory`, written on ``writer``'s thread after a copy into ``buffers``."""
    save_checkpoint_dir_in_background(strategy.parts, checkpoint, path, tag, writer, buffers)


def find_sharded_tensor(obj: Any, path: tuple[Hashable, ...] = ()) -> tuple[str, str] | None:
    """(key path, type name) of the first DTensor/ShardedTensor in a nested checkpoint dict; or None."""
    if type(obj).__name__ in _SHARDED_TENSOR_TYPES:
        return "/".join(map(str, path)) or "<root>", type(obj).__name__
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = find_sharded_tensor(value, (*path, key))
        if found is not None:
            return found
    return None


def refuse_sharded_tensors(checkpoint: dict[str, Any]) -> None:
    """Raise ValueError, naming the key, if ``checkpoint`` holds a sharded tensor (one rank's part)."""
    found = find_sharded_tensor(checkpoint)
    if found is not None:
        raise ValueError(
            f"the state to save holds a {found[1]} at {found[0]!r}, one rank's shard: Rank0Checkpoint "
            "would write a partial checkpoint. Save through the strategy with Lightning's ModelCheckpoint, "
            "or configure the strategy to gather a full state dict"
        )


def check_strategy_internals() -> list[str]:
    """Private strategy attributes that :func:`sharded_strategy_problem` reads and that are gone (2.6.6)."""
    problems = []
    if getattr(FSDPStrategy(state_dict_type="sharded"), "_state_dict_type", None) != "sharded":
        problems.append("FSDPStrategy._state_dict_type")
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False)
    if getattr(strategy, "_save_distributed_checkpoint", None) is not False:
        problems.append("ModelParallelStrategy._save_distributed_checkpoint")
    return problems
