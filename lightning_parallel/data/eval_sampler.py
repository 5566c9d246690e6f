"""Distributed evaluation sampler that shards a data set without padding (each sample seen once)."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lightning_parallel._options import checks_options

__all__ = ["EvalDistributedSampler", "eval_shard"]


def eval_shard(num_samples: int, num_replicas: int, rank: int) -> range:
    """The indices rank ``rank`` of ``num_replicas`` evaluates: ``rank, rank + W, ...`` below ``num_samples``.

    The shards partition ``range(num_samples)``: their sizes differ by at most one and no index repeats
    (``DistributedSampler`` instead pads the last shards with copies of the first samples).
    """
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank ({rank}) must be in [0, num_replicas ({num_replicas}))")
    return range(rank, num_samples, num_replicas)


class EvalDistributedSampler(DistributedSampler):
    """Strided, unpadded, unshuffled shards of a data set for distributed validation and testing.

    Sample ``i`` goes to rank ``i % num_replicas``, as with ``DistributedSampler(shuffle=False)``, but the
    shards are not padded to equal length, so a metric over the union of the shards is the metric over
    the data set. Ranks may then run one batch more than others: any collective per batch must allow for
    that (``AllReducedMetrics`` syncs only the batches every rank runs). It subclasses
    ``DistributedSampler`` so that Lightning keeps it instead of injecting its own.

    Args:
        dataset: the data set (only its length is used).
        num_replicas: number of shards (default: the world size).
        rank: this shard (default: the global rank).

    Example::

        sampler = EvalDistributedSampler(dataset, num_replicas=2, rank=1)
        list(EvalDistributedSampler(range(5), num_replicas=2, rank=1))  # [1, 3]
    """

    @checks_options
    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self._shard = eval_shard(len(dataset), num_replicas, rank)
        self.num_samples = len(self._shard)
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(self._shard)

    def __len__(self) -> int:
        return self.num_samples
