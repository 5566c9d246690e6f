"""data/batch_fingerprint.py: which samples a batch holds, compared over the ranks of each replica.

Pure logic: each rank's row is built here from the batch that rank would hold, and compared as the
gathered table would be (strategies/pipeline/same_data.py's spawned test runs the gather itself).
"""

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel.data.batch_fingerprint import SLOTS, check_same_batch, compare, fingerprint

CPU = torch.device("cpu")
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(8, 3, 5, generator=G), torch.randint(0, 10, (8,), generator=G)


def _compare(*batches, replicas=None, pipeline_ranks=None):
    """Rank r holds batches[r], in replica replicas[r], at pipeline rank pipeline_ranks[r] (default: 0, r)."""
    replicas = replicas or [0] * len(batches)
    pipeline_ranks = pipeline_ranks or list(range(len(batches)))
    rows = [fingerprint(b).row(d, p, CPU).tolist() for b, d, p in zip(batches, replicas, pipeline_ranks)]
    return compare(rows, fingerprint(batches[0]))


def test_the_same_batch_agrees_and_a_world_split_sampler_does_not():
    assert _compare((X, Y), (X.clone(), Y.clone()), (X, Y)) == []
    # DistributedSampler(dataset) on 2 pipeline ranks of one replica: rank 0 reads 0, 2, ..., rank 1 1, 3, ...
    data = list(zip(X, Y))
    first = [
        next(iter(DataLoader(data, 4, sampler=DistributedSampler(data, 2, r, shuffle=False)))) for r in (0, 1)
    ]
    (found,) = _compare(*first)
    assert found.fatal and found.ranks == (0, 1) and found.parts == ("batch[0]", "batch[1]")
    message = found.message(batch_idx=0)
    assert "replica 0 read different training batches at batch 0" in message
    assert (
        "global rank 0 (pipeline rank 0) and global rank 1 (pipeline rank 1) differ in batch[0], batch[1]"
        in message
    )
    assert "DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs)" in message


def test_the_same_samples_in_another_order_differ():
    order = torch.tensor([1, 0, *range(2, 8)])
    (found,) = _compare((X, Y), (X[order], Y[order]))
    assert found.fatal


def test_floating_point_parts_alone_differ_while_labels_agree_is_a_warning():
    (found,) = _compare((X, Y), (X + 0.01, Y))  # augmentation drawn differently on each rank
    assert not found.fatal and found.parts == ("batch[0]",)
    assert "random augmentation" in found.message(batch_idx=2)


def test_only_parts_that_tell_no_samples_apart_agree_is_an_error():
    mask = torch.ones(8, 5)  # an all-ones mask agrees whatever the samples
    (found,) = _compare((X, mask), (X + 1, mask))
    assert found.fatal
    (found,) = _compare({"ids": Y, "mask": mask.long()}, {"ids": Y.flip(0), "mask": mask.long()})
    assert found.fatal and found.parts == ("batch['ids']",)


def test_tensor_parallel_ranks_of_one_stage_must_agree_even_on_floating_point_parts():
    (found,) = _compare((X, Y), (X + 0.01, Y), pipeline_ranks=[0, 0])
    assert found.fatal


def test_a_different_shape_or_structure_differs():
    (found,) = _compare((X, Y), (X[:4], Y[:4]))
    assert found.fatal and "structure" in found.parts[0]
    assert _compare({"a": Y, "b": X}, {"b": X, "a": Y}) == []  # key order is not structure


def test_replicas_read_different_batches_and_are_compared_within_themselves():
    # 2 stages x 2 replicas (global rank = pipeline rank x 2 + replica): each replica's stages agree
    batches = [(X, Y), (X + 1, Y + 1), (X, Y), (X + 1, Y + 1)]
    assert _compare(*batches, replicas=[0, 1, 0, 1], pipeline_ranks=[0, 0, 1, 1]) == []
    (found,) = _compare(*batches[:3], (X, Y), replicas=[0, 1, 0, 1], pipeline_ranks=[0, 0, 1, 1])
    assert found.replica == 1 and found.ranks == (1, 3) and found.fatal


def test_python_values_and_many_parts():
    texts = [f"sample {i}" for i in range(8)]
    (found,) = _compare({"x": X, "text": texts}, {"x": X, "text": texts[::-1]})
    assert found.fatal and found.parts == ("batch['text']",)
    fp = fingerprint({"x": X, "text": texts, "step": 3, "note": None})
    assert fp.names == ("batch['note']", "batch['step']", "batch['text']", "batch['x']")
    assert fp.exact == (True, True, True, False)
    assert fp.telling.tolist() == [False, False, True, True]

    many = [Y + i for i in range(SLOTS)] + [X + i for i in range(4)]
    fp = fingerprint(many)
    assert len(fp.names) == SLOTS and fp.names[-2:] == ("2 more exact parts", "4 more floating-point parts")
    changed = [*many[:-1], many[-1] + 1]
    (found,) = _compare(many, changed)
    assert found.parts == ("4 more floating-point parts",) and not found.fatal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.bool])
def test_every_dtype_is_read_as_its_bits(dtype):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert _compare(x, x.clone()) == []
    y = x.clone()
    y[2, 1] = 1 if dtype == torch.bool and not bool(x[2, 1]) else 0
    assert len(_compare(x, y)) == 1


def test_what_cannot_be_read_is_compared_by_its_type_and_a_single_process_check_goes_on():
    sparse = torch.eye(3).to_sparse()
    fp = fingerprint({"m": sparse, "tag": object(), "x": X})
    assert fp.names == ("batch['x']",)
    assert fingerprint({"m": sparse, "tag": object(), "x": X}).structure == fp.structure
    assert check_same_batch((X, Y), replica=0, pipeline_rank=0, batch_idx=0) == []  # no process group
