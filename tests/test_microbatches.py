"""pipeline/microbatches.py: one step's batch size and micro-batches, split as torch's schedule splits."""

import pytest
import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from lightning_parallel.pipeline.microbatches import (
    StepMicrobatches,
    batch_size,
    first_microbatch,
    microbatch_count,
    split_microbatches,
)


def test_the_count_is_the_largest_divisor_of_the_batch_up_to_the_configured_one():
    assert [microbatch_count(n, 4) for n in (16, 12, 10, 7, 6, 3, 1)] == [4, 4, 2, 1, 3, 3, 1]
    with pytest.raises(ValueError, match="empty batch"):
        microbatch_count(0, 4)


def test_the_batch_size_is_dim_0_of_the_first_batched_tensor():
    assert batch_size({"lr": torch.tensor(0.1), "ids": torch.zeros(5, 3)}) == 5
    with pytest.raises(TypeError, match="could not find a batched tensor"):
        batch_size(["no", "tensor"])


def test_the_micro_batches_are_the_ones_the_schedule_feeds():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    ours = split_microbatches((x, y), 3)
    torch_chunks, _ = split_args_kwargs_into_chunks((x, y), None, 3)
    assert len(ours) == 3
    for mine, theirs in zip(ours, torch_chunks):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    a, b = first_microbatch((x, y), 3)
    assert torch.equal(a, x[:2]) and torch.equal(b, y[:2])


def test_a_step_decides_once_and_splits_its_batch_once():
    batch = (torch.zeros(6, 4), torch.ones(6))
    mb = StepMicrobatches.of(batch, num_microbatches=4)  # 6 samples: 3 micro-batches of 2
    assert (mb.size, mb.count, mb.sizes) == (6, 3, [2, 2, 2])
    chunks = mb.batch_chunks()
    assert mb.batch_chunks() is chunks  # split once, whoever asks
    assert [tuple(t.shape) for t in chunks[0]] == [(2, 4), (2,)]
