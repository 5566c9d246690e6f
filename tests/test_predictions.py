"""interleave_replicas: the replicas' predictions of one batch step back in dataset order."""

import pytest
import torch

from lightning_parallel.pipeline.predictions import interleave_replicas


def _strided_batches(num_samples: int, replicas: int, batch_size: int) -> list[list[torch.Tensor]]:
    """Each replica's batches of sample indices, as Lightning's strided, unpadded predict sampler makes."""
    shards = [torch.arange(r, num_samples, replicas) for r in range(replicas)]
    return [list(shard.split(batch_size)) for shard in shards]


@pytest.mark.parametrize(("num_samples", "replicas", "batch_size"), [(12, 2, 3), (11, 3, 2), (7, 4, 1)])
def test_the_steps_put_together_give_the_dataset_in_order(num_samples, replicas, batch_size):
    batches = _strided_batches(num_samples, replicas, batch_size)
    steps = max(len(b) for b in batches)
    merged = [interleave_replicas([b[step] for b in batches if step < len(b)]) for step in range(steps)]
    assert torch.cat(merged).tolist() == list(range(num_samples))


def test_one_replica_is_returned_as_it_is():
    prediction = {"logits": torch.randn(3, 2), "id": "not a tensor"}
    assert interleave_replicas([prediction]) is prediction


def test_tuples_and_dicts_of_batched_tensors_keep_their_structure():
    parts = [
        {"y": torch.tensor([[0.0], [2.0]]), "pair": (torch.tensor([0, 2]), torch.tensor([10, 12]))},
        {"y": torch.tensor([[1.0]]), "pair": (torch.tensor([1]), torch.tensor([11]))},
    ]
    merged = interleave_replicas(parts)
    assert merged["y"].tolist() == [[0.0], [1.0], [2.0]]
    assert merged["pair"][0].tolist() == [0, 1, 2] and merged["pair"][1].tolist() == [10, 11, 12]


@pytest.mark.parametrize("leaf", [torch.tensor(1.0), 3.5, "text"])
def test_predictions_not_batched_along_dim_0_are_refused(leaf):
    with pytest.raises(TypeError, match=r"predict_step returns tensors .* batched along dim 0"):
        interleave_replicas([leaf, leaf])
