"""A distributed sampler whose position inside an epoch can be saved and resumed at another world size."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lightning_parallel._options import checks_options

__all__ = ["ResumableDistributedSampler", "find_resumable_samplers", "single_loader_batch_size"]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (same permutation, padding and per-rank split) that can start mid-epoch.

    Each epoch has one global order (``randperm`` seeded with ``seed + epoch``, as in PyTorch's
    sampler). Replica ``r`` of ``N`` takes ``order[r::N]``, so after every replica has drawn ``k``
    samples the samples consumed are exactly the prefix ``order[:k * N]``, whatever ``N`` was.
    :meth:`resume` starts the epoch after such a prefix and splits only the rest over the current
    replicas: no sample twice, none skipped, also when the world size changed in between.

    Unlike PyTorch's sampler it needs no process group at construction: unless given,
    ``num_replicas`` and ``rank`` are read from the process group when the sampler is used (1 and 0
    without one: the world, which under DDP is the data-parallel replicas). Under
    :class:`~lightning_parallel.PipelineStrategy`, whose replicas are fewer than its ranks (every
    stage of a replica reads the same samples), the strategy sets them to its data-parallel layout
    (``trainer.strategy.distributed_sampler_kwargs``) when Lightning prepares the loader: nothing to
    pass. Because it is a ``DistributedSampler``, Lightning keeps it instead of injecting its own.

    Args:
        dataset: a map-style dataset (``len`` is required).
        num_replicas: data-parallel replicas (default: the process group's size, 1 without one; the
            strategy's replicas under ``PipelineStrategy``).
        rank: this replica's index (default: the process group's rank, 0 without one; the strategy's
            replica index under ``PipelineStrategy``).
        shuffle: shuffle each epoch with ``seed + epoch`` (as ``DistributedSampler``).
        seed: the base seed; must be the same on every replica.
        drop_last: drop the tail instead of padding it to a multiple of ``num_replicas``.

    Example::

        loader = DataLoader(dataset, batch_size=32, sampler=ResumableDistributedSampler(dataset))
        trainer = L.Trainer(devices=8, callbacks=[Rank0Checkpoint(every_n_train_steps=500)])
        # the same loader under PipelineStrategy(pipeline_size=2): split over the 4 replicas, not the 8 ranks
    """

    @checks_options
    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        # DistributedSampler.__init__ is skipped: it needs an initialised process group.
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                "ResumableDistributedSampler needs a map-style dataset with __len__, "
                f"got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0
        self.offset = 0
        self._resumed_epoch: int | None = None
        self._explicit: tuple[int, int] | None = None
        if num_replicas is not None or rank is not None:
            self.set_distributed(1 if num_replicas is None else num_replicas, 0 if rank is None else rank)

    def set_distributed(self, num_replicas: int, rank: int) -> None:
        """Set the data-parallel size and this replica's index (instead of the process group's)."""
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"invalid rank {rank} for num_replicas {num_replicas}: need num_replicas >= 1 and "
                "0 <= rank < num_replicas"
            )
        self._explicit = (num_replicas, rank)

    @property
    def distributed_given(self) -> bool:
        """Whether ``num_replicas``/``rank`` were given (or set), rather than read from the process group."""
        return self._explicit is not None

    def _replicas_and_rank(self) -> tuple[int, int]:
        if self._explicit is not None:
            return self._explicit
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """Data-parallel replicas: as set, else the process group's world size (1 without one)."""
        return self._replicas_and_rank()[0]

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._replicas_and_rank()[1]

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """Samples drawn this epoch by all replicas together after the resume point (padding included)."""
        rest = len(self.dataset) - self.start
        if self.drop_last:
            return rest - rest % self.num_replicas
        return math.ceil(rest / self.num_replicas) * self.num_replicas

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return self.total_size // self.num_replicas

    def global_order(self) -> list[int]:
        """This epoch's order over the whole data set (identical on every replica)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()
        return list(range(len(self.dataset)))

    def _remaining(self) -> list[int]:
        rest = self.global_order()[self.start :]
        size = self.total_size
        if size > len(rest) and rest:
            rest += (rest * math.ceil((size - len(rest)) / len(rest)))[: size - len(rest)]
        return rest[:size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.offset + self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, unless it is the epoch :meth:`resume` just moved into."""
        if epoch == self._resumed_epoch:
            self._resumed_epoch = None  # the loop announcing the epoch it resumes: keep the position
            return
        self.epoch = epoch
        self.start = 0
        self.offset = 0

    def resume(self, consumed: int, offset: int = 0) -> None:
        """Skip the first ``consumed`` samples of this epoch's global order (drawn before a restart).

        ``offset`` is added to ``len(self)`` only: a training loop that restores its batch counter
        (Lightning does) and ends the epoch at ``len`` then runs exactly the remaining batches.
        """
        if consumed < 0 or offset < 0:
            raise ValueError(f"consumed and offset must be >= 0, got {consumed} and {offset}")
        self.start = min(consumed, len(self.dataset))
        self.offset = offset
        self._resumed_epoch = self.epoch if consumed or offset else None

    def consumed_after(self, samples_per_replica: int) -> int:
        """Global position after every replica drew ``samples_per_replica`` samples since the resume point."""
        return min(self.start + samples_per_replica * self.num_replicas, len(self.dataset))

    def state_dict(self, samples_per_replica: int = 0) -> dict[str, Any]:
        """The position to checkpoint after ``samples_per_replica`` draws per replica since the resume."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed_after(samples_per_replica),
            "dataset_len": len(self.dataset),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any], offset: int = 0) -> None:
        """Resume at a position from :meth:`state_dict`; the data set, seed and shuffle must match."""
        expected = (len(self.dataset), self.seed, self.shuffle)
        saved = (state["dataset_len"], state["seed"], state["shuffle"])
        if saved != expected:
            raise ValueError(
                f"sampler state (dataset_len, seed, shuffle) = {saved} does not match this sampler's "
                f"{expected}: resume with the same data set and sampler arguments"
            )
        self.epoch = state["epoch"]
        self.resume(state["consumed"], offset)


def find_resumable_samplers(loaders: Any) -> Iterator[ResumableDistributedSampler]:
    """The :class:`ResumableDistributedSampler` of each loader in ``loaders`` (a loader, dicts or lists).

    Example::

        samplers = list(find_resumable_samplers(trainer.train_dataloader))
    """
    for loader in _flatten(loaders):
        sampler = getattr(loader, "sampler", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        for s in (sampler, getattr(batch_sampler, "sampler", None)):
            if isinstance(s, ResumableDistributedSampler):
                yield s
                break


def single_loader_batch_size(loaders: Any) -> int | None:
    """The ``batch_size`` of ``loaders`` when it is one loader; None otherwise.

    Example::

        single_loader_batch_size(DataLoader(dataset, batch_size=32))  # 32
    """
    flat = list(_flatten(loaders))
    return getattr(flat[0], "batch_size", None) if len(flat) == 1 else None


def _flatten(loaders: Any) -> Iterator[Any]:
    if loaders is None:
        return
    if isinstance(loaders, dict):
        for v in loaders.values():
            yield from _flatten(v)
    elif isinstance(loaders, list | tuple):
        for v in loaders:
            yield from _flatten(v)
    else:
        yield loaders
