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
