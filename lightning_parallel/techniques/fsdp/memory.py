"""What FSDP2 does to a rank's bytes, for the planner: its shard of each parameter, the stage gathered.

Pure arithmetic on the planner's measured tensors (rows of dim 0, bytes, optimizer state), apart from
the technique's ``memory`` member (``technique.py``), which folds it into the planner's ledger, so that
the rule for a shard's size (``pipeline/plan.py``'s ``shard_rows``, FSDP2's even split of dim 0) is read
in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_parallel.pipeline.plan import shard_rows


@dataclass(frozen=True)
class ShardedBytes:
    """What FSDP2 does to a stage's parameter bytes on one rank: its shard, and the whole stage gathered.

    Under a pipeline the stage is gathered once per step (``reshard_after_forward=False``) and stays
    gathered from its first forward to the end of the schedule; its unsharded gradients live until the
    one reduce-scatter before the optimizer step (so the gradient bytes do not shrink until then).
    """

    shard: int
    gathered: int


def state_bytes(tensors: Sequence[Any], shards: int) -> int:
    """The optimizer state of the fullest shard of each tensor (the planner's ``Tensor``: ``numel``,
    ``rows``, ``state``), per-tensor state such as Adam's ``step`` whole.

    Example::

        state_bytes([facts.tensors[k] for k in keys], 2)
    """
    out = 0
    for t in tensors:
        if t.state:
            out += t.state.of(
                round(t.numel * (shard_rows(t.rows, shards) / t.rows)) if shards > 1 else t.numel
            )
    return out


def memory(tensors: Sequence[tuple[int, int]], shards: int) -> ShardedBytes:
    """The memory effect of sharding tensors given as ``(rows of dim 0, bytes)`` over ``shards`` ranks.

    Example::

        >>> memory([(13, 13 * 8 * 4), (8, 8 * 4)], 2)
        ShardedBytes(shard=240, gathered=448)
    """
    shard = sum(round(nbytes * shard_rows(rows, shards) / rows) for rows, nbytes in tensors)
    return ShardedBytes(shard, sum(nbytes for _, nbytes in tensors))
