"""Item-weighted losses without processes: the counts, the window's arithmetic, one device accumulating.

Covers callbacks/token_loss.py (TokenWeightedLoss) on one device, and callbacks/_step_wrapping.py (the
wrapper it sets on training_step, which the accumulation scheduler sets too).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from mp_harness import assert_close_dicts, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_parallel import TokenWeightedLoss, labelled_tokens
from lightning_parallel.grads.item_weights import ItemWindow, hugging_face_count, scale_gradients
from lightning_parallel.pipeline.step_logs import weighted_mean


def test_labelled_tokens_counts_what_the_loss_averages_over():
    labels = torch.tensor([[-100, 1, 2, -100], [3, -100, -100, -100]])
    assert int(labelled_tokens()({"labels": labels})) == 3
    assert int(labelled_tokens(1)((None, labels))) == 3
    assert int(labelled_tokens(shift=True)({"labels": labels})) == 2  # labels[..., 1:]
    assert int(labelled_tokens(ignore_index=3)({"labels": labels})) == 7
    with pytest.raises(TypeError, match="is a list, not a tensor"):
        labelled_tokens()({"labels": [1, 2]})


class _Head(nn.Module):
    def __init__(self, loss_type):
        super().__init__()
        self.loss_type = loss_type


class _Adapted(nn.Module):  # peft's PeftModel: get_base_model() is the model it wraps
    def __init__(self, base):
        super().__init__()
        self.base = base

    def get_base_model(self):
        return self.base


def test_a_hugging_face_model_is_counted_as_its_own_loss_counts():
    labels = torch.tensor([[-100, 1, 2], [4, -100, 5]])
    assert int(hugging_face_count(_Head("ForCausalLM"), {"labels": labels})) == 3  # shifted: [1:]
    assert int(hugging_face_count(_Head("ForMaskedLM"), {"labels": labels})) == 4
    assert int(hugging_face_count(_Head("ForCausalLM"), {"shift_labels": labels})) == 4
    assert int(hugging_face_count(_Adapted(_Head("ForCausalLM")), {"labels": labels})) == 3
    assert hugging_face_count(_Head("ForSequenceClassification"), {"labels": labels}) is None
    assert hugging_face_count(_Head("ForCausalLM"), {"input_ids": labels}) is None


def test_the_window_turns_weighted_batch_means_into_the_token_mean():
    """Two batches of 3 and 5 tokens: weighted as the window says, the gradient is the 8 tokens' mean."""
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    tokens = [torch.randn(3, 4), torch.randn(5, 4)]
    window = ItemWindow()
    for x in tokens:
        reference = window.add_batch(torch.tensor(float(len(x))), group=None)
        ((x @ w).mean() * window.loss_weight(len(x))).backward()
        assert reference == 3.0  # the window's first batch
    scale_gradients([w], window.gradient_factor(replicas=1))
    expected = torch.autograd.grad((torch.cat(tokens) @ w).mean(), w)[0]
    torch.testing.assert_close(w.grad, expected)
    assert window.reference is None and window.total == 0  # the next batch starts a new window


def test_a_micro_batch_without_labelled_tokens_counts_for_nothing():
    assert weighted_mean([2.0, float("nan"), 4.0], [1.0, 0.0, 3.0]) == pytest.approx(3.5)
    assert weighted_mean([float("nan")], [0.0]) != weighted_mean([float("nan")], [0.0])  # NaN: no items


class PaddedLM(L.LightningModule):
    """A token model trained on right-padded batches whose prompts and pads are labelled -100."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten(), ignore_index=-100)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _padded(n: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        t = int(torch.randint(3, 12, (1,), generator=g))
        x = torch.randint(0, 11, (t,), generator=g)
        y = torch.randint(0, 11, (t,), generator=g)
        y[: int(torch.randint(0, t, (1,), generator=g))] = -100
        items.append((x, y))
    return items


def _collate(items):
    t = max(len(x) for x, _ in items)
    x = torch.zeros(len(items), t, dtype=torch.long)
    y = torch.full((len(items), t), -100)
    for i, (a, b) in enumerate(items):
        x[i, : len(a)], y[i, : len(b)] = a, b
    return x, y


@pytest.mark.parametrize("accumulate", [2, 4])
def test_one_device_with_accumulation_equals_one_big_batch(accumulate):
    """Lightning #20350: accumulated padded batches weighted by their tokens are the big batch exactly."""
    data = _padded()
    big = PaddedLM()
    quiet_trainer(max_steps=2).fit(big, DataLoader(data, batch_size=2 * accumulate, collate_fn=_collate))
    small = PaddedLM()
    callbacks = [TokenWeightedLoss(count=labelled_tokens(1))]
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=accumulate, callbacks=callbacks)
    trainer.fit(small, DataLoader(data, batch_size=2, collate_fn=_collate))
    assert_close_dicts(small.state_dict(), big.state_dict(), rtol=1e-5, atol=1e-6)
    assert "training_step" not in vars(small)  # the wrapper is gone at teardown
    plain = PaddedLM()  # and without the callback it is not: the check can fail
    quiet_trainer(max_steps=2, accumulate_grad_batches=accumulate).fit(
        plain, DataLoader(data, batch_size=2, collate_fn=_collate)
    )
    assert (plain.head.weight - big.head.weight).abs().max() > 1e-4


def test_token_weighted_loss_refuses_what_it_cannot_count():
    with pytest.raises(TypeError, match="takes a function of a batch"):
        TokenWeightedLoss(count="labels")
