"""Tiny models and data sets shared by the tests: small enough for N processes on 2 cores."""

from __future__ import annotations

import itertools

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, d_in: int = 8, d_out: int = 4, seed: int = 0) -> TensorDataset:
    """A fixed random regression data set (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, d_out, generator=g))


def loader(dataset, batch_size: int, shuffle: bool = False, drop_last: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)


class SequentialRegressor(L.LightningModule):
    """An MLP held in one top-level ``nn.Sequential``, the shape PipelineStrategy splits."""

    def __init__(
        self,
        d_in: int = 8,
        hidden: int = 16,
        d_out: int = 4,
        depth: int = 4,
        lr: float = 0.1,
        adam: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.adam = lr, adam
        dims = [d_in] + [hidden] * (depth - 1)
        blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(dims)]
        self.layers = nn.Sequential(*blocks, nn.Linear(dims[-1], d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.adam:
            return torch.optim.AdamW(self.parameters(), lr=self.lr / 10)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FlatRegressor(L.LightningModule):
    """An MLP in two named layers, no ``nn.Sequential`` and no ``nn.ModuleList``: nothing a pipeline can
    split, so ``PipelineStrategy(pipeline_size=1)`` runs it whole on each rank."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, lr: float = 0.01):
        super().__init__()
        self.lr = lr
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TokenModel(L.LightningModule):
    """A tiny token model (embedding -> MLP blocks -> head) on (batch, time) ids: shapes may vary."""

    def __init__(self, vocab: int = 11, dim: int = 8, depth: int = 3, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        blocks = [nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)]
        self.layers = nn.Sequential(nn.Embedding(vocab, dim), *blocks, nn.Linear(dim, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class VariableLengthTokens(torch.utils.data.Dataset):
    """Token sequences whose length changes every ``batch_size`` samples (batches of one length)."""

    def __init__(self, n: int = 40, batch_size: int = 8, vocab: int = 11, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            t = 3 + (i // batch_size) % 3
            seq = torch.randint(0, vocab, (t + 1,), generator=g)
            self.items.append((seq[:-1], seq[1:]))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, the mask built in forward (as nanoGPT does without flash)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        # No bias: the key bias has an exactly-zero gradient (softmax ignores it), and AdamW would turn
        # its rounding noise into updates that differ between any two ways of computing it.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class SdpaSelfAttention(CausalSelfAttention):
    """The same attention through ``F.scaled_dot_product_attention`` (what sequence parallelism splits)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def with_sdpa(model: nn.Module) -> nn.Module:
    """``model`` with every :class:`CausalSelfAttention` made an :class:`SdpaSelfAttention` (its weights)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is CausalSelfAttention:
                sdpa = SdpaSelfAttention(child.proj.in_features, child.heads)
                sdpa.load_state_dict(child.state_dict())
                setattr(module, name, sdpa)
    return model


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.ln_2, self.mlp = (
            nn.LayerNorm(dim),
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(L.LightningModule):
    """A nanoGPT-shaped LM: wte + wpe, a ModuleList of blocks, ln_f, lm_head tied to wte. No Sequential."""

    def __init__(self, vocab: int = 13, dim: int = 8, depth: int = 4, heads: int = 2, block_size: int = 8,
                 lr: float = 0.05):  # fmt: skip
        super().__init__()
        self.lr = lr
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TokenAndPosition(nn.Module):
    """A GPT's input layer: token plus learned position embeddings."""

    def __init__(self, vocab: int, dim: int, block_size: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class SequentialGPT(TinyGPT):
    """TinyGPT's network in one top-level ``nn.Sequential`` (embeddings, blocks, ln_f, head), AdamW.

    The Sequential path splits it between its children, so its stages are real modules that FSDP2
    can shard (the traced path cannot). ``tied``: the head shares the token embedding (two stages).
    """

    def __init__(self, vocab: int = 13, dim: int = 8, depth: int = 4, heads: int = 2, block_size: int = 8,
                 lr: float = 0.05, tied: bool = False):  # fmt: skip
        L.LightningModule.__init__(self)
        self.lr = lr
        head = nn.Linear(dim, vocab, bias=False)
        embed = TokenAndPosition(vocab, dim, block_size)
        if tied:
            head.weight = embed.wte.weight
        blocks = [Block(dim, heads) for _ in range(depth)]
        self.layers = nn.Sequential(embed, *blocks, nn.LayerNorm(dim), head)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layers(idx)


class NanoGPT(TinyGPT):
    """TinyGPT with nanoGPT's forward: ``forward(idx, targets=None) -> (logits, loss)``, the loss inside."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = super().forward(idx)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self(x, y)
        self.log("train_loss", loss)
        return loss


class SkipBlock(Block):
    """A block that also reads a padding mask (bool) and the embeddings x0 (a value residual)."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        keep = keep.unsqueeze(-1).to(x.dtype)
        x = x + self.attn(self.ln_1(x)) * keep + 0.5 * x0
        return x + self.mlp(self.ln_2(x)) * keep


class SkipGPT(TinyGPT):
    """TinyGPT whose ``forward(idx, keep)`` hands values past the next stage, as litgpt and HF decoders do.

    The padding mask ``keep`` is a root input read only from ``h.mask_from`` on (so the first stage does not
    read it), and the embeddings ``x0`` reach every block (a skip whose gradient flows back to stage 0).
    Batches are ``(idx, keep, targets)``.
    """

    def __init__(self, depth: int = 4, mask_from: int = 2):
        super().__init__(depth=depth)
        self.mask_from = mask_from
        self.h = nn.ModuleList(SkipBlock(8, 2) for _ in range(depth))

    def forward(self, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x0 = x = self.wte(idx) + self.wpe(pos)
        everything = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
        for i, block in enumerate(self.h):
            x = block(x, keep if i >= self.mask_from else everything, x0)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        idx, keep, y = batch
        loss = F.cross_entropy(self(idx, keep).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        idx, keep, y = batch
        self.log("val_loss", F.cross_entropy(self(idx, keep).flatten(0, 1), y.flatten()))

    def predict_step(self, batch, batch_idx):
        return self(batch[0], batch[1]).argmax(-1)


def rotate_half_in_float32(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding computed in float32 with autocast off, as x-transformers and others do:
    ``torch.autocast(x.device.type, enabled=False)`` asks the input its device."""
    with torch.autocast(x.device.type, enabled=False):
        # (No x[...] indexing: on fake CUDA tensors it needs a CUDA build, and test_trace fakes CUDA.)
        half = x.shape[-1] // 2
        freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angles = torch.outer(positions.float(), freqs)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


class DeviceAwareAttention(CausalSelfAttention):
    """Rotary attention that picks its kernel by the input's device, as many libraries do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        positions = torch.arange(t, device=x.device)
        q, k = rotate_half_in_float32(q, positions), rotate_half_in_float32(k, positions)
        if x.device.type == "cuda":  # the fused kernel on a GPU
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class DeviceAwareGPT(TinyGPT):
    """TinyGPT whose attention asks its input's device: ``torch.autocast(x.device.type, enabled=False)``
    around the rotary embedding, and ``if x.device.type == "cuda"`` to choose the attention kernel."""

    def __init__(self, depth: int = 4):
        super().__init__(depth=depth)
        for block in self.h:
            block.attn = DeviceAwareAttention(8, 2)


def masked_token_data(n: int = 32, t: int = 8, vocab: int = 13, seed: int = 0) -> TensorDataset:
    """``(idx, keep, targets)``: token_data with a padding mask that keeps about 80% of the positions."""
    idx, targets = token_data(n, t, vocab, seed).tensors
    keep = torch.rand(n, t, generator=torch.Generator().manual_seed(seed + 1)) > 0.2
    return TensorDataset(idx, keep, targets)


def token_data(n: int = 48, t: int = 8, vocab: int = 13, seed: int = 0) -> TensorDataset:
    """Sequences with a learnable pattern (next token = token + 1 mod vocab, with noise)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    seq = (start + torch.arange(t + 1)) % vocab
    flip = torch.rand(n, t + 1, generator=g) < 0.1
    seq = torch.where(flip, torch.randint(0, vocab, (n, t + 1), generator=g), seq)
    return TensorDataset(seq[:, :-1], seq[:, 1:])
