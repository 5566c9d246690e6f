"""A GPT with separate q, k, v in one top-level ``nn.Sequential`` (embedding, blocks, norm, head): the
shape PipelineStrategy splits into manual stages and can split over tensor-parallel ranks.

Its attention uses the local heads: it reshapes with ``self.heads`` and ``-1``, and the tensor-parallel
plan sets ``heads`` to the heads of one rank.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from tiny_models import TinyGPT, TokenModel
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, block_size: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (no bias: the key bias has no gradient)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            nn.LayerNorm(dim),
            Attention(dim, heads),
            nn.LayerNorm(dim),
            MLP(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SplitQkvGPT(TokenModel):
    """``layers = Sequential(Embed, Block x depth, LayerNorm, Linear head)``, trained with SGD + momentum.

    TokenModel's steps (next-token cross-entropy), another network.
    """

    def __init__(self, vocab: int = 13, dim: int = 16, depth: int = 2, heads: int = 4, block_size: int = 8,
                 lr: float = 0.1):  # fmt: skip
        L.LightningModule.__init__(self)
        self.lr = lr
        blocks = [Block(dim, heads) for _ in range(depth)]
        self.layers = nn.Sequential(
            Embed(vocab, dim, block_size), *blocks, nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SplitQkvTinyGPT(TinyGPT):
    """TinyGPT's shape (embeddings, a ModuleList of blocks, a head tied to the token embedding), its blocks
    with separate q, k, v: the traced path's model for tensor parallelism. SGD + momentum, as SplitQkvGPT.
    """

    def __init__(self, vocab: int = 13, dim: int = 16, depth: int = 2, heads: int = 4, block_size: int = 8,
                 lr: float = 0.1):  # fmt: skip
        super().__init__(vocab, dim, depth, heads, block_size, lr)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
