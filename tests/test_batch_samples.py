"""data/batch_samples.py: the samples in a batch, as the pipeline splits it and accumulation checks it."""

from collections import namedtuple

import pytest
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_parallel.data.batch_samples import samples_in

Pair = namedtuple("Pair", "x y")

COMMON_BATCHES = [
    torch.zeros(5, 3),
    (torch.zeros(8, 3), torch.zeros(8)),
    [torch.zeros(2, 4, 4), torch.zeros(2, dtype=torch.long)],
    {"ids": torch.zeros(4, 16, dtype=torch.long), "mask": torch.ones(4, 16, dtype=torch.bool)},
    Pair(torch.zeros(6), torch.zeros(6)),
    ({"a": torch.zeros(7, 1)}, [torch.zeros(7)]),
]


@pytest.mark.parametrize("batch", COMMON_BATCHES, ids=lambda b: type(b).__name__)
def test_common_batches_count_as_lightning_counts_them(batch):
    assert samples_in(batch) == extract_batch_size(batch)


def test_scalars_hold_no_samples():
    # Lightning would answer 1 for the leading 0-dim tensor; the pipeline splits the (3, 2) one.
    assert samples_in((torch.tensor(0.5), torch.zeros(3, 2))) == 3
    assert samples_in({"name": "x", "step": 4, "x": torch.zeros(9)}) == 9
    assert samples_in(["no", "tensor", 1.5]) is None
    assert samples_in(torch.tensor(2.0)) is None
    assert samples_in(()) is None
