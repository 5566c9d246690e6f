"""Tiny models that log torchmetrics Metrics the ways Lightning users do, and their data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchmetrics
from tiny_models import SequentialRegressor, TinyGPT
from tiny_tp_models import SplitQkvGPT
from torch.utils.data import TensorDataset
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassF1Score,
    MulticlassPrecision,
)
from torchmetrics.text import Perplexity

CLASSES = 3


def class_data(n: int, seed: int = 0) -> TensorDataset:
    """Inputs whose class is mostly the arg-max of their first features: learnable, not trivially."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :CLASSES].argmax(1) + (torch.rand(n, generator=g) < 0.3).long()) % CLASSES
    return TensorDataset(x, y)


class MetricClassifier(SequentialRegressor):
    """An MLP classifier (one top-level Sequential) logging Metrics in every step method.

    * training: ``acc(logits, y)`` then ``self.log(acc)`` on step and epoch (synced on step, so its step
      value is the global batch's), a running mean of per-sample losses (``update``), a persistent
      sample count (saved in checkpoints, never logged) and a SumMetric logged on epoch;
    * validation: accuracy and AUROC (list states) by ``update``, a collection by ``self.log_dict``, and
      a mean computed and logged in ``on_validation_epoch_end``;
    * test: accuracy by ``forward``.
    """

    def __init__(self, lr: float = 0.2) -> None:
        super().__init__(d_out=CLASSES, lr=lr)
        self.train_acc = MulticlassAccuracy(CLASSES, average="micro", dist_sync_on_step=True)
        self.train_nll = torchmetrics.MeanMetric()
        self.seen = torchmetrics.SumMetric()
        self.seen.persistent(True)
        self.seen_logged = torchmetrics.SumMetric()
        self.val_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.val_auroc = MulticlassAUROC(CLASSES)
        self.val_set = torchmetrics.MetricCollection(
            {"f1": MulticlassF1Score(CLASSES), "prec": MulticlassPrecision(CLASSES)}, prefix="val_"
        )
        self.val_mean = torchmetrics.MeanMetric()
        self.test_acc = MulticlassAccuracy(CLASSES, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.train_nll.update(F.cross_entropy(logits, y, reduction="none"))
        self.log("train_nll", self.train_nll, on_step=False, on_epoch=True)
        self.seen.update(torch.tensor(float(len(y))))
        self.seen_logged.update(torch.tensor(float(len(y))))
        self.log("seen", self.seen_logged, on_step=False, on_epoch=True)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc)
        self.val_auroc.update(logits.softmax(-1), y)
        self.log("val_auroc", self.val_auroc)
        self.val_set.update(logits, y)
        self.log_dict(self.val_set)
        self.val_mean.update(F.cross_entropy(logits, y, reduction="none"))
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("val_mean", self.val_mean.compute())  # computed outside a step, on every rank
        self.val_mean.reset()

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)


class _TokenMetrics:
    """Next-token cross-entropy with a Perplexity and a token accuracy, for the GPT-shaped models."""

    def _add_metrics(self, vocab: int) -> None:
        self.train_ppl = Perplexity(dist_sync_on_step=True)
        self.val_ppl = Perplexity()
        self.val_tok_acc = MulticlassAccuracy(vocab, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.train_ppl(logits, y)
        self.log("train_ppl", self.train_ppl, on_step=True, on_epoch=True)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_ppl.update(logits, y)
        self.log("val_ppl", self.val_ppl)
        self.val_tok_acc(logits.flatten(0, 1), y.flatten())
        self.log("val_tok_acc", self.val_tok_acc)


class MetricGPT(_TokenMetrics, TinyGPT):
    """TinyGPT (a ModuleList of blocks, a tied head: the traced path) with token metrics."""

    def __init__(self) -> None:
        TinyGPT.__init__(self)
        self._add_metrics(13)


class MetricTPGPT(_TokenMetrics, SplitQkvGPT):
    """SplitQkvGPT (one Sequential, separate q/k/v: tensor parallel stages) with token metrics."""

    def __init__(self) -> None:
        SplitQkvGPT.__init__(self)
        self._add_metrics(13)
