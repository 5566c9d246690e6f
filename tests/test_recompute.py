"""Activation checkpointing of a stage's units: same numbers, fewer saved bytes, reversible."""

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.techniques.recompute import (
    apply_activation_checkpointing,
    is_checkpointed,
    remove_activation_checkpointing,
    select_units,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 16))  # noqa: E731
    return nn.Sequential(block(), block(), block(), nn.Linear(16, 1))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and the bytes autograd saved for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved.values())


def test_gradients_and_loss_are_bitwise_equal_and_fewer_bytes_are_saved():
    x = torch.randn(32, 16)
    model = _model()
    loss, grads, saved = _step(model, x)

    wrapped = _model()
    units = list(wrapped.named_children())
    assert apply_activation_checkpointing(units, True) == ["0", "1", "2", "3"]
    loss_ac, grads_ac, saved_ac = _step(wrapped, x)

    assert torch.equal(loss, loss_ac)  # dropout draws the same mask in the recomputation
    for name in grads:
        assert torch.equal(grads[name], grads_ac[name]), name
    # Inside a checkpointed unit nothing is saved: only the units' inputs stay alive.
    assert saved > 0 and saved_ac < saved / 4


def test_selection_by_names_and_by_callable():
    model = _model()
    units = list(model.named_children())
    assert apply_activation_checkpointing(units, ["2", "0"]) == ["0", "2"]
    assert [is_checkpointed(m) for m in model] == [True, False, True, False]
    assert apply_activation_checkpointing(units, lambda name, m: isinstance(m, nn.Linear)) == ["3"]
    assert select_units(units, False) == []
    assert apply_activation_checkpointing(units, []) == []


def test_unknown_names_are_named_with_the_available_ones():
    units = list(_model().named_children())
    with pytest.raises(ValueError, match=r"do not exist: \['h.7'\]; the units are \['0', '1', '2', '3'\]"):
        apply_activation_checkpointing(units, ["1", "h.7"])
    with pytest.raises(TypeError, match="a list of unit names, got '1'"):
        apply_activation_checkpointing(units, "1")


def test_wrapping_keeps_state_dict_keys_and_is_reversible():
    model = _model()
    keys = list(model.state_dict())
    forward_before = model[1].forward
    units = list(model.named_children())
    apply_activation_checkpointing(units, True)
    apply_activation_checkpointing(units, True)  # twice: still one level of checkpointing
    assert list(model.state_dict()) == keys
    assert list(dict(model.named_parameters())) == [k for k in keys]
    assert remove_activation_checkpointing(units) == ["0", "1", "2", "3"]
    assert not any(is_checkpointed(m) for m in model)
    assert model[1].forward == forward_before and "forward" not in model[1].__dict__


def test_a_deep_copy_recomputes_its_own_layers():
    model = _model()
    apply_activation_checkpointing(list(model.named_children()), True)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    x = torch.randn(4, 16)
    assert torch.equal(clone(x), torch.zeros(4, 1))  # not the original's weights
    assert not torch.equal(model(x), torch.zeros(4, 1))
