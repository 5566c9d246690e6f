"""techniques/sequence_parallel/'s decisions, without processes: heads, shards, masks, positions, labels.

The exchanges and the attention against one device are in test_sequence_parallel_exact.py (gloo ranks).
Covers techniques/sequence_parallel/heads.py, shards.py, masks.py, positions.py, labels.py, graph.py
(the nodes a rewrite finds in an exported program) and eager.py's reading of torch's mode stack.
"""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_parallel.techniques.attention_masks import is_causal_pattern
from lightning_parallel.techniques.sequence_parallel.eager import is_on
from lightning_parallel.techniques.sequence_parallel.graph import (
    Rewritten,
    ShardPositions,
    UlyssesCall,
    rewrite_stage,
)
from lightning_parallel.techniques.sequence_parallel.heads import check_heads, sizes_that_work
from lightning_parallel.techniques.sequence_parallel.labels import pass_group_labels, shifts_labels
from lightning_parallel.techniques.sequence_parallel.masks import causal_over_all_tokens, check_window
from lightning_parallel.techniques.sequence_parallel.positions import (
    arange_bounds,
    is_positions,
    offset_positions,
    pass_position_ids,
    takes_position_ids,
)
from lightning_parallel.techniques.sequence_parallel.shards import sequence_length, shard_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def test_the_group_size_must_divide_both_head_counts_and_the_error_names_the_sizes_that_work():
    assert sizes_that_work(32, 8) == [1, 2, 4, 8] and sizes_that_work(6) == [1, 2, 3, 6]
    check_heads(4, 32, 8)
    with pytest.raises(
        ValueError, match=r"4 query heads and 2 key/value heads: 4 must divide both; .* 1, 2$"
    ):
        check_heads(4, 4, 2)
    with pytest.raises(
        ValueError, match=r"sequence_parallel_size=2 .* 3 heads: 2 must divide them; .* 1, 3$"
    ):
        check_heads(2, 3)


# ------------------------------------------------------------------------------------------ shards


def test_each_rank_takes_one_contiguous_shard_of_every_per_token_tensor():
    ids = torch.arange(16).view(2, 8)
    per_sample = torch.tensor([3, 4])
    Batch = namedtuple("Batch", "ids targets weight")
    for index in range(4):
        x, y, w = shard_batch(Batch(ids, ids + 100, per_sample), index, 4)
        assert x.tolist() == [[2 * index, 2 * index + 1], [8 + 2 * index, 9 + 2 * index]]
        assert y.tolist() == (x + 100).tolist() and x.is_contiguous()
        assert w is per_sample  # no sequence dimension: whole
    batch = {"input_ids": ids, "other": torch.zeros(2, 3), "nested": [ids.unsqueeze(-1)]}
    out = shard_batch(batch, 1, 2)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert out["other"].shape == (2, 3)  # another length: whole
    assert out["nested"][0].shape == (2, 4, 1)
    assert shard_batch((ids.T,), 0, 2, seq_dim=0)[0].shape == (4, 2)


def test_a_length_k_does_not_divide_is_refused_naming_the_padding_helpers():
    with pytest.raises(
        ValueError, match=r"are 7 tokens long .*padding_to_multiple\(collate_fn, 2, .*pad_to_multiple"
    ):
        shard_batch((torch.zeros(2, 7), torch.zeros(2, 7)), 0, 2)
    with pytest.raises(TypeError, match="no tensor with 2 dimensions"):
        sequence_length({"x": torch.zeros(3), "y": 1})


def test_right_padding_is_left_out_of_the_mask_and_other_padding_is_refused():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    labels = torch.tensor([[5, 6, 7, 8], [5, 6, -100, -100]])
    out = shard_batch({"input_ids": labels.clamp(min=0), "attention_mask": mask, "labels": labels}, 1, 2)
    assert out["attention_mask"].tolist() == [[1, 1], [1, 1]]  # causal attention is exact without it
    assert out["labels"].tolist() == [[7, 8], [-100, -100]]
    left = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"needs right padding: batch\['attention_mask'\] pads before"):
        shard_batch({"input_ids": labels, "attention_mask": left}, 0, 2)
    holes = torch.tensor([[1, 0, 1, 1]])
    with pytest.raises(ValueError, match="left padding, or holes"):
        shard_batch({"input_ids": labels[:1], "attention_mask": holes}, 0, 2)
    labelled = {"input_ids": labels, "attention_mask": mask, "labels": labels.clamp(min=0)}
    with pytest.raises(ValueError, match=r"batch\['labels'\] has labels other than -100 where"):
        shard_batch(labelled, 0, 2)
    tuple_batch = shard_batch((labels, mask), 1, 2)  # a mask with no name: split as it is (refused later)
    assert tuple_batch[1].tolist() == [[1, 1], [0, 0]]


# ------------------------------------------------------------------------------------------- masks


def test_only_the_causal_pattern_carries_over_to_every_token():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~tril, float("-inf"))
    hf_style = torch.zeros(1, 1, 4, 4).masked_fill(~tril, torch.finfo(torch.float32).min)
    assert is_causal_pattern(tril.expand(2, 1, 4, 4)) and is_causal_pattern(additive)
    assert is_causal_pattern(hf_style)
    padded = tril.clone()
    padded[:, 3] = False
    assert not is_causal_pattern(padded) and not is_causal_pattern(torch.zeros(4, 4))
    assert not is_causal_pattern(tril.int()) and not is_causal_pattern(tril[:3])
    assert causal_over_all_tokens(None, False, 4) == (False, None)  # full attention: exact too
    assert causal_over_all_tokens(additive, False, 4) == (True, None)
    causal, why = causal_over_all_tokens(tril[:2, :2], False, 4)  # made for another length
    assert not causal and "shape (2, 2) on a shard of 4 tokens" in why
    assert causal_over_all_tokens(tril, True, 4)[1] is not None  # SDPA itself refuses both


def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    mistral = SimpleNamespace(config=SimpleNamespace(sliding_window=4, layer_types=None))
    check_window(mistral, 4)
    with pytest.raises(ValueError, match=r"sliding window of 4 tokens: train on sequences of at most 4"):
        check_window(mistral, 8)
    full = SimpleNamespace(config=SimpleNamespace(sliding_window=4, layer_types=["full_attention"] * 2))
    check_window(full, 8)  # Qwen2 without use_sliding_window: every layer full
    check_window(nn.Linear(2, 2), 10**6)


# --------------------------------------------------------------------------------------- positions


def test_the_position_arange_is_recognised_and_offset():
    assert arange_bounds((4,), {}) == (0, 4, 1) and arange_bounds((1, 4, 2), {}) == (1, 4, 2)
    assert arange_bounds((), {"end": 4}) == (0, 4, 1)
    assert arange_bounds((4,), {"dtype": torch.long}) == (0, 4, 1)
    assert is_positions(torch.arange(4), (0, 4, 1), 4)
    assert is_positions(torch.arange(4), (0, torch.tensor(4), 1), 4)
    assert not is_positions(torch.arange(4), (0, 4, 1), 2)  # another length (a batch index)
    assert not is_positions(torch.arange(4.0), (0, 4, 1), 4)  # rotary frequencies are floats
    assert not is_positions(torch.arange(1, 5), (1, 5, 1), 4)
    assert offset_positions(torch.arange(3), 2).tolist() == [6, 7, 8]
    assert offset_positions(torch.arange(3).view(1, 3), 0).tolist() == [[0, 1, 2]]


class _TakesPositions(nn.Module):
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return position_ids


def test_a_model_that_takes_position_ids_is_given_the_shards():
    model = _TakesPositions()
    assert takes_position_ids(model) and not takes_position_ids(nn.Linear(2, 2))
    handle = pass_position_ids(model, index=2)
    assert model(input_ids=torch.zeros(3, 4)).tolist() == [[8, 9, 10, 11]]
    assert model(torch.zeros(1, 2)).tolist() == [[4, 5]]
    given = torch.tensor([[0, 1]])
    assert model(torch.zeros(1, 2), position_ids=given) is given  # the call's own win
    assert model(torch.zeros(1, 2), None, given) is given
    handle.remove()
    assert model(torch.zeros(1, 2)) is None
    with pytest.raises(ValueError, match=r"Linear\.forward takes no position_ids"):
        pass_position_ids(nn.Linear(2, 2), 0)


def test_only_a_model_that_shifts_its_labels_gets_them_shifted_across_shards():
    assert shifts_labels(SimpleNamespace(loss_type="ForCausalLM"))
    peft = SimpleNamespace(get_base_model=lambda: SimpleNamespace(loss_type="ForCausalLM"))
    assert shifts_labels(peft)
    assert not shifts_labels(SimpleNamespace(loss_type="ForSequenceClassification"))
    with pytest.raises(ValueError, match="Linear does not shift its labels"):
        pass_group_labels(nn.Linear(2, 2), group=None)


# ------------------------------------------------------------------------------------------- graph


class _Attention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = x.view(b, t, 2, -1).transpose(1, 2) + torch.arange(t).view(1, 1, t, 1)  # positions
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, -1) + torch.arange(b).view(b, 1, 1)  # a batch index


def test_the_rewrite_finds_attention_nodes_and_the_sequence_arange_only():
    x = torch.randn(3, 4, 8)
    dims = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    dynamic = torch.export.export(_Attention(), (x,), dynamic_shapes=dims).module()
    assert rewrite_stage(dynamic, group=None) == Rewritten(1, 1)  # the batch's arange has another symbol
    targets = [type(n.target) for n in dynamic.graph.nodes if n.op == "call_function"]
    assert UlyssesCall in targets and ShardPositions in targets
    static = torch.export.export(_Attention(), (x,)).module()
    assert rewrite_stage(static, group=None, positions=False) == Rewritten(1, 0)
    static = torch.export.export(_Attention(), (x,)).module()
    assert rewrite_stage(static, group=None, tokens=4) == Rewritten(1, 1)  # a static trace: by number
    square = torch.export.export(_Attention(), (torch.randn(4, 4, 8),)).module()
    with pytest.raises(ValueError, match="4 samples and 4 tokens a shard"):
        rewrite_stage(square, group=None, tokens=4)


# ------------------------------------------------------------------------------------------- eager


def test_a_function_mode_is_off_in_a_checkpoint_recomputation_and_is_on_says_so():
    """What eager.py relies on (torch 2.13): a mode entered around backward() is not on in a block's
    recomputation, so the recomputed forward enters it itself; and is_on reads torch's private stack."""
    seen = []

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    probe = Probe()

    def block(x):
        seen.append(is_on(probe))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with probe:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    assert seen == [True, False]  # forward in it; recomputation, though inside the with, not
    assert not is_on(probe)
