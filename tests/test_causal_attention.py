"""techniques/causal_attention.py: a traced stage's attention whose mask is the causal pattern runs as
``is_causal=True`` (no mask kept for backward), any other mask as it is. One process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim, export

from lightning_parallel.techniques.causal_attention import CausalWhenMasked, rewrite_causal_masks

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch.export, inside torch


class MaskedAttention(nn.Module):
    """Builds its mask in forward, as a Hugging Face decoder does under export: the causal pattern, with
    the padding (0 in ``keep``) masked out as well."""

    def forward(self, q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _calls(monkeypatch) -> list[dict]:
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append({"mask": attn_mask is not None, "causal": is_causal})
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def test_a_causal_mask_becomes_is_causal_and_any_other_mask_is_kept(monkeypatch):
    q = torch.randn(2, 2, 6, 4)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    padded = causal & torch.tensor([0, 1, 1, 1, 1, 1]).bool()  # (left padding: not the causal pattern)
    want = {
        name: F.scaled_dot_product_attention(q, q, q, m)
        for name, m in (("causal", causal), ("padded", padded))
    }
    seen = _calls(monkeypatch)
    torch.testing.assert_close(CausalWhenMasked()(q, q, q, causal), want["causal"])
    torch.testing.assert_close(CausalWhenMasked()(q, q, q, padded), want["padded"])
    additive = torch.zeros(6, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    torch.testing.assert_close(CausalWhenMasked()(q, q, q, additive), want["causal"])
    assert seen == [
        {"mask": False, "causal": True},
        {"mask": True, "causal": False},
        {"mask": False, "causal": True},
    ]


def test_the_traced_stages_attention_is_rewritten_and_computes_the_same(monkeypatch):
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    keep = torch.ones(2, 8, dtype=torch.long)
    program = export(
        MaskedAttention(), (q, keep), dynamic_shapes=({2: Dim.AUTO}, {1: Dim.AUTO}), strict=False
    )
    stage = program.module()
    assert rewrite_causal_masks(stage) == 1
    assert rewrite_causal_masks(stage) == 0  # (its node is no longer an SDPA call)
    seen = _calls(monkeypatch)
    for keep_now, causal in ((keep, True), (keep.clone().index_fill_(1, torch.tensor([0]), 0), False)):
        got = stage(q, keep_now)
        want = MaskedAttention()(q, keep_now)
        torch.testing.assert_close(got, want)
        g_got, g_want = (torch.autograd.grad(o.square().sum(), q) for o in (got, want))
        torch.testing.assert_close(g_got, g_want)
        assert seen[0] == {"mask": not causal, "causal": causal}
        seen.clear()
