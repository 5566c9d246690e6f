"""data/sampler_layout.py: a loader's distributed sampler split over the replicas, not the world.

Pure logic, no process group: the layouts are given as numbers (a process group's, where the
sampler reads it, is stood in for by monkeypatching torch.distributed's queries).
"""

import pytest
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_parallel.data.eval_sampler import EvalDistributedSampler
from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler
from lightning_parallel.data.sampler_layout import distributed_samplers, fit_samplers_to_replicas

DATA = list(range(21))
# pipeline_size=2 x 2 replicas on 4 ranks: global rank 3 is replica 1
REPLICAS, REPLICA, WORLD, RANK = 2, 1, 4, 3


def _fit(loader) -> list[str]:
    return fit_samplers_to_replicas(loader, REPLICAS, REPLICA, WORLD, RANK)


@pytest.mark.parametrize("drop_last", [False, True])
def test_pytorchs_sampler_split_over_the_world_is_split_over_the_replicas(drop_last):
    sampler = DistributedSampler(DATA, num_replicas=WORLD, rank=RANK, seed=7, drop_last=drop_last)
    sampler.set_epoch(3)
    loader = DataLoader(DATA, batch_size=2, sampler=sampler)
    (note,) = _fit(loader)
    assert "num_replicas=4, rank=3" in note and "(num_replicas=2, rank=1)" in note
    expected = DistributedSampler(DATA, num_replicas=REPLICAS, rank=REPLICA, seed=7, drop_last=drop_last)
    expected.set_epoch(3)
    assert loader.sampler is sampler and list(sampler) == list(expected)
    assert len(loader) == len(DataLoader(DATA, batch_size=2, sampler=expected))
    assert _fit(loader) == []  # now as wanted: left alone


def test_resumable_sampler_takes_the_replicas_silently_unless_given(monkeypatch):
    # Its default is the process group's layout: the world's 4 ranks, read when it is used.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: RANK)
    default = ResumableDistributedSampler(DATA, seed=1)
    assert (default.num_replicas, default.rank, default.distributed_given) == (WORLD, RANK, False)
    assert _fit(DataLoader(DATA, sampler=default)) == []  # its documented default: nothing to say
    assert (default.num_replicas, default.rank) == (REPLICAS, REPLICA)
    assert list(default) == list(ResumableDistributedSampler(DATA, REPLICAS, REPLICA, seed=1))

    given = ResumableDistributedSampler(DATA, num_replicas=WORLD, rank=RANK, seed=1)
    given.resume(6)  # a resumed position survives the new split
    (note,) = _fit(DataLoader(DATA, sampler=given))
    assert "ResumableDistributedSampler split the data over the world" in note
    expected = ResumableDistributedSampler(DATA, REPLICAS, REPLICA, seed=1)
    expected.resume(6)
    assert given.start == 6 and list(given) == list(expected)


def test_eval_sampler_and_a_batch_samplers_sampler_are_split_too():
    evaluation = EvalDistributedSampler(DATA, num_replicas=WORLD, rank=RANK)
    _fit(DataLoader(DATA, sampler=evaluation))
    assert list(evaluation) == list(range(REPLICA, len(DATA), REPLICAS)) and len(evaluation) == 10

    inner = DistributedSampler(DATA, num_replicas=WORLD, rank=RANK, shuffle=False)
    loader = DataLoader(DATA, batch_sampler=BatchSampler(inner, batch_size=4, drop_last=False))
    assert list(distributed_samplers(loader)) == [inner]
    _fit(loader)
    assert [i for batch in loader for i in batch] == [*range(REPLICA, len(DATA), REPLICAS), 0]  # padded


def test_a_sampler_already_split_over_the_replicas_or_no_sampler_is_left_alone():
    sampler = DistributedSampler(DATA, num_replicas=REPLICAS, rank=REPLICA)
    before = dict(vars(sampler))
    assert _fit(DataLoader(DATA, sampler=sampler)) == [] and vars(sampler) == before
    assert _fit(DataLoader(DATA, shuffle=True)) == [] and _fit([1, 2]) == []


def test_another_layout_set_by_hand_is_refused_with_the_values_and_the_fix():
    by_hand = DistributedSampler(DATA, num_replicas=1, rank=0)
    wrong = r"has num_replicas=1, rank=0, but this rank's data-parallel replica is rank 1 of num_replicas=2"
    with pytest.raises(ValueError, match=wrong) as err:
        _fit(DataLoader(DATA, sampler=by_hand))
    assert "Set by hand to another layout" in str(err.value)
    assert "DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs)" in str(err.value)
    assert (by_hand.num_replicas, by_hand.rank) == (1, 0)


def test_a_subclass_split_over_the_world_is_refused_not_rebuilt():
    class Weighted(DistributedSampler):
        pass

    refused = r"Weighted has num_replicas=4, rank=3.*A Weighted \(a subclass\) is not rebuilt"
    with pytest.raises(ValueError, match=refused):
        _fit(DataLoader(DATA, sampler=Weighted(DATA, num_replicas=WORLD, rank=RANK)))
