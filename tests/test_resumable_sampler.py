"""ResumableDistributedSampler: PyTorch's split at the start of an epoch, an exact rest after a resume."""

import pytest
from torch.utils.data import DistributedSampler

from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler


def _draws(n: int, replicas: int, start: int = 0, epoch: int = 0, **kwargs) -> list[list[int]]:
    samplers = []
    for rank in range(replicas):
        s = ResumableDistributedSampler(range(n), num_replicas=replicas, rank=rank, **kwargs)
        s.set_epoch(epoch)
        s.resume(start)
        samplers.append(list(s))
    return samplers


@pytest.mark.parametrize(
    "n, replicas, drop_last", [(48, 2, False), (50, 3, False), (50, 3, True), (7, 4, False)]
)
def test_matches_pytorch_distributed_sampler_from_the_start(n, replicas, drop_last):
    for rank in range(replicas):
        ours = ResumableDistributedSampler(range(n), replicas, rank, seed=3, drop_last=drop_last)
        theirs = DistributedSampler(range(n), replicas, rank, seed=3, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("before, after", [(2, 2), (2, 1), (1, 2), (4, 3)])
def test_resume_sees_every_remaining_sample_once_at_any_world_size(before, after):
    n, per_replica = 48, 5
    first = [ids[:per_replica] for ids in _draws(n, before, epoch=1)]
    sampler = ResumableDistributedSampler(range(n), before, 0, seed=0)
    sampler.set_epoch(1)
    consumed = sampler.state_dict(per_replica)["consumed"]
    assert consumed == per_replica * before
    rest = _draws(n, after, start=consumed, epoch=1)
    seen = [i for ids in first for i in ids] + [i for ids in rest for i in ids]
    unique = set(seen)
    assert unique == set(range(n))
    # Only the padding of the last step may repeat a sample, as in an uninterrupted run.
    assert len(seen) - len(unique) == sum(len(ids) for ids in rest) - (n - consumed)
    # The consumed samples are exactly the prefix of the epoch's global order.
    assert {i for ids in first for i in ids} == set(sampler.global_order()[:consumed])


def test_state_dict_round_trip_and_lengths():
    s = ResumableDistributedSampler(range(20), 2, 1, seed=5)
    s.set_epoch(2)
    state = s.state_dict(3)
    t = ResumableDistributedSampler(range(20), 4, 3, seed=5)
    t.load_state_dict(state)
    assert (t.epoch, t.start) == (2, 6)
    assert len(t) == 4 and len(list(t)) == 4  # 14 left over 4 replicas: padded to 16
    t.set_epoch(2)  # the loop announcing the resumed epoch keeps the position
    assert t.start == 6
    t.set_epoch(3)
    assert t.start == 0 and len(t) == 5


def test_bad_arguments_raise_with_values():
    with pytest.raises(ValueError, match=r"rank 2 for num_replicas 2"):
        ResumableDistributedSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(TypeError, match="map-style"):
        ResumableDistributedSampler(iter(range(4)))
    s = ResumableDistributedSampler(range(4), seed=1)
    with pytest.raises(ValueError, match=r"does not match"):
        s.load_state_dict({**s.state_dict(), "dataset_len": 5})
    with pytest.raises(ValueError, match="consumed and offset must be >= 0"):
        s.resume(-1)
