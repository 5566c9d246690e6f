"""data/padding.py: a batch's sequences padded to a multiple of a length (pure logic, tiny tensors)."""

import pytest
import torch

from lightning_parallel.data.padding import pad_to_multiple, padding_to_multiple


def test_every_tensor_with_the_dimension_is_padded_on_the_right_with_its_keys_value():
    ids, mask = torch.arange(10).reshape(2, 5), torch.ones(2, 5, dtype=torch.bool)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone(), "lengths": torch.tensor([5, 3])}
    padded = pad_to_multiple(batch, 4, {"labels": -100})
    assert type(padded) is dict and list(padded) == list(batch)
    assert padded["input_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 0, 0], [5, 6, 7, 8, 9, 0, 0, 0]]
    assert padded["labels"][1].tolist() == [5, 6, 7, 8, 9, -100, -100, -100]
    assert padded["attention_mask"].dtype is torch.bool and not padded["attention_mask"][:, 5:].any()
    assert padded["lengths"] is batch["lengths"]  # no dimension 1: left as it is


def test_nested_tuples_and_lists_keep_their_types_and_a_length_already_a_multiple_is_untouched():
    x, y = torch.ones(3, 6, 2), torch.zeros(3, 8)
    padded = pad_to_multiple((x, [y, "text"]), 4)
    assert type(padded) is tuple and type(padded[1]) is list and padded[1][1] == "text"
    assert padded[0].shape == (3, 8, 2) and padded[0][:, 6:].eq(0).all() and padded[0][:, :6].eq(1).all()
    assert padded[1][0] is y  # 8 is a multiple of 4: the same tensor


def test_another_sequence_dimension():
    padded = pad_to_multiple(torch.ones(2, 3, 5), 4, dim=2)
    assert padded.shape == (2, 3, 8) and padded[..., 5:].eq(0).all()


@pytest.mark.parametrize("multiple", [0, -8, 2.0, True, "8"])
def test_a_multiple_that_is_not_a_positive_int_is_refused(multiple):
    with pytest.raises(ValueError, match=r"multiple must be a positive int, got"):
        pad_to_multiple(torch.ones(1, 1), multiple)
    with pytest.raises(ValueError, match=r"multiple must be a positive int, got"):
        padding_to_multiple(list, multiple)  # at construction, not at the first batch


def test_the_collate_function_pads_what_the_inner_one_returns():
    def stack(samples):
        return {"input_ids": torch.stack(samples), "labels": torch.stack(samples)}

    collate = padding_to_multiple(stack, 8, {"labels": -100})
    batch = collate([torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    assert batch["input_ids"].shape == (2, 8) and batch["input_ids"][0].tolist() == [1] * 3 + [0] * 5
    assert batch["labels"][1].tolist() == [1] * 3 + [-100] * 5
