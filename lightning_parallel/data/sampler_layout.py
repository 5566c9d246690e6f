"""A loader's distributed sampler split over the data-parallel replicas, not over the world.

Under a pipeline the world is ``pipeline x replicas (x tensor)`` ranks and every rank of one replica
must read the same samples: the first stage's activations meet the last stage's labels. A
``DistributedSampler(dataset)`` built without arguments (as DDP code builds it) splits over the world
instead. :func:`fit_samplers_to_replicas` sets such a sampler to the replicas in place (the samplers it
knows how to rebuild) and refuses any other layout that is not the replicas' with the values and the
fix. Pure PyTorch (no Lightning import).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

from lightning_parallel.data.eval_sampler import EvalDistributedSampler
from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler

__all__ = ["distributed_samplers", "fit_samplers_to_replicas"]

FIX = (
    "build it with the strategy's data-parallel layout, e.g. "
    "DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs), or pass no sampler and "
    "let Lightning split the data (shuffle=True for training)"
)


def distributed_samplers(loader: Any) -> Iterator[DistributedSampler]:
    """The ``DistributedSampler``s of ``loader``: its ``sampler`` and its batch sampler's ``sampler``.

    Example::

        list(distributed_samplers(DataLoader(ds, sampler=DistributedSampler(ds, 2, 0))))  # [the sampler]
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            yield sampler


def fit_samplers_to_replicas(
    loader: Any, num_replicas: int, rank: int, world_size: int, global_rank: int
) -> list[str]:
    """Split each distributed sampler of ``loader`` over ``num_replicas`` replicas (this one: ``rank``).

    A sampler already split so is left alone. One split over the world (``world_size``, ``global_rank``:
    what ``DistributedSampler(dataset)`` and ``ResumableDistributedSampler(dataset)`` take by default) is
    set to the replicas in place, if it is one of the samplers this knows how to rebuild (PyTorch's
    ``DistributedSampler``, ``ResumableDistributedSampler``, ``EvalDistributedSampler``). Returns a note
    for each sampler so changed whose layout was the user's to give (empty when there is nothing to say).

    Raises:
        ValueError: a sampler with any other layout, or a subclass this cannot rebuild split over the
            world: the values, and how to build it.

    Example::

        # pipeline_size=2 on 2 processes: one replica; the DDP idiom splits over the world (2, rank)
        loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=2, rank=1))
        fit_samplers_to_replicas(loader, num_replicas=1, rank=0, world_size=2, global_rank=1)
        loader.sampler.num_replicas, loader.sampler.rank  # 1, 0
    """
    notes = []
    for sampler in distributed_samplers(loader):
        note = _fit(sampler, num_replicas, rank, world_size, global_rank)
        if note:
            notes.append(note)
    return notes


def _fit(sampler: DistributedSampler, num_replicas: int, rank: int, world_size: int, global_rank: int) -> str:
    have, want = (sampler.num_replicas, sampler.rank), (num_replicas, rank)
    if have == want:
        return ""
    name = type(sampler).__name__
    where = (
        f"a DataLoader's {name} has num_replicas={have[0]}, rank={have[1]}, but this rank's data-parallel "
        f"replica is rank {rank} of num_replicas={num_replicas}: every stage of a pipeline must read the "
        "same samples"
    )
    if have != (world_size, global_rank):
        raise ValueError(f"{where}. Set by hand to another layout, it is not changed here: {FIX}")
    if type(sampler) not in (DistributedSampler, ResumableDistributedSampler, EvalDistributedSampler):
        raise ValueError(f"{where}. A {name} (a subclass) is not rebuilt here: {FIX}")
    given = not isinstance(sampler, ResumableDistributedSampler) or sampler.distributed_given
    _resplit(sampler, num_replicas, rank)
    if not given:
        return ""  # ResumableDistributedSampler(dataset): the replicas are its documented default here
    return (
        f"{name} split the data over the world (num_replicas={have[0]}, rank={have[1]}); it is set to the "
        f"data-parallel replicas (num_replicas={num_replicas}, rank={rank}) so that every stage of a "
        "pipeline reads the same samples"
    )


def _resplit(sampler: DistributedSampler, num_replicas: int, rank: int) -> None:
    """``sampler`` split over ``num_replicas`` in place, its other settings and its epoch kept."""
    if isinstance(sampler, ResumableDistributedSampler):
        sampler.set_distributed(num_replicas, rank)  # keeps a resumed position
        return
    if isinstance(sampler, EvalDistributedSampler):
        fresh: DistributedSampler = EvalDistributedSampler(sampler.dataset, num_replicas, rank)
    else:
        fresh = DistributedSampler(
            sampler.dataset, num_replicas, rank, sampler.shuffle, sampler.seed, sampler.drop_last
        )
    fresh.epoch = sampler.epoch
    # The constructor derives its sizes (num_samples, total_size, a shard) from the layout: take them all.
    vars(sampler).update(vars(fresh))
