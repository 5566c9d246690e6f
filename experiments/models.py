"""The experiments' shared models and their data: a byte-level transformer LM on Python's own sources.

- :class:`CharLM`: the main job's model (``train_charlm.py``, ``scaling_charlm.py``, ``gpu_check.py``):
  an ordinary GPT as people write it (embeddings, a ``ModuleList`` of blocks, a head tied to the token
  embedding, no ``nn.Sequential``), which PipelineStrategy splits by tracing its ``forward``.
- :class:`SequentialCharLM`: the same network with its layers in one ``nn.Sequential`` (the head tied
  or not), which PipelineStrategy splits between its children; the pipeline benchmarks use it.
- :func:`stdlib_text`, :class:`ByteWindows`, :class:`StdlibText`: the text, its windows, the DataModule;
  :func:`unigram_bits_per_byte`, the yardstick the main job's loss is printed beside.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_parallel.pipeline.partition import partition_balanced

__all__ = [
    "Block",
    "ByteWindows",
    "CharLM",
    "Embedding",
    "SequentialCharLM",
    "StdlibText",
    "stdlib_text",
    "unigram_bits_per_byte",
]

# ------------------------------------------------------------------------------------------- data


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's ``.py`` sources, concatenated in a fixed order, up to ``max_bytes``.

    Example::

        len(stdlib_text(1000))   # 1000
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def unigram_bits_per_byte(data: bytes) -> float:
    """The entropy of the bytes' own frequencies, in bits per byte: what a model that ignores context
    reaches at best, a yardstick for the LM's loss.

    Example::

        unigram_bits_per_byte(b"abab")   # 1.0
    """
    counts = torch.bincount(torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), minlength=256)
    p = counts[counts > 0].double() / len(data)
    return float(-(p * p.log2()).sum())


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (input, next-byte target).

    Example::

        data = torch.frombuffer(bytearray(stdlib_text(10_000)), dtype=torch.uint8)
        x, y = ByteWindows(data, seq_len=64)[0]   # two int64 tensors of 64 bytes, y shifted by one
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]

    @classmethod
    def of_stdlib(cls, windows: int, seq_len: int) -> ByteWindows:
        """The first ``windows`` windows of the standard library's text.

        Example::

            ByteWindows.of_stdlib(windows=64, seq_len=32)
        """
        raw = stdlib_text(windows * (seq_len + 1) + 1)
        return cls(torch.frombuffer(bytearray(raw), dtype=torch.uint8), seq_len)


class StdlibText(L.LightningDataModule):
    """The stdlib's text as a DataModule: the last ``val_fraction`` of the bytes for validation.

    Example::

        trainer.fit(CharLM(), StdlibText(seq_len=64, batch_size=16, max_bytes=2_000_000))
    """

    def __init__(self, seq_len: int, batch_size: int, max_bytes: int, val_fraction: float = 0.05) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.max_bytes, self.val_fraction = max_bytes, val_fraction

    def setup(self, stage: str) -> None:
        data = torch.frombuffer(bytearray(stdlib_text(self.max_bytes)), dtype=torch.uint8)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.seq_len)
        self.val_set = ByteWindows(data[split:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


# ------------------------------------------------------------------------------------------ layers


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, dim: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """A pre-norm causal transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class SplitQKVBlock(nn.Module):
    """:class:`Block` with separate q, k, v projections and an MLP of ``fc`` and ``proj``, on local heads.

    What ``PipelineStrategy(tensor_parallel_size=t)``'s default plan splits: it sets ``heads`` to the
    heads of one rank, and the forward reshapes with ``self.heads`` and ``-1``.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _SplitAttention(dim, heads)
        self.mlp = _FcProj(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _SplitAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _FcProj(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


# ------------------------------------------------------------------------------------------ models


def warmup_cosine(step: int, steps: int, warmup: int) -> float:
    """The LR factor at ``step``: a linear rise over ``warmup`` steps, then a cosine down to 0 at ``steps``.

    Example::

        [round(warmup_cosine(s, 10, 2), 2) for s in (0, 1, 2, 6, 10)]   # [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < warmup:
        return (step + 1) / warmup
    done = (min(step, steps) - warmup) / max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * done))


def adamw_with_cosine_decay(module: L.LightningModule, warmup: int = 0) -> dict[str, Any]:
    """AdamW whose learning rate rises over ``warmup`` steps, then decays to 0 along a cosine."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=module.hparams.lr, weight_decay=0.01)
    # The run's optimizer steps, accumulation included (GradientAccumulationScheduler sets them).
    steps = max(1, int(module.trainer.estimated_stepping_batches))
    warmup = min(warmup, steps // 2)  # a short run (a smoke test) still gets its decay
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, warmup))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _gpt_init(module: nn.Module) -> None:
    """GPT-2's initialisation: small normal weights, so the tied head starts near uniform predictions."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class NextByteLM(L.LightningModule):
    """The steps both forms of the byte-level LM share: next-byte cross-entropy, logged."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = _next_byte_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", _next_byte_loss(self(x), y), prog_bar=True)


class SequentialCharLM(NextByteLM):
    """The byte-level LM with its layers in one ``nn.Sequential`` (what PipelineStrategy splits), AdamW.

    Example::

        model = SequentialCharLM(dim=64, depth=2, seq_len=32)
        len(model.layers)   # embedding, 2 blocks, final norm, head: 5
        SequentialCharLM(tied=True).state_dict()   # the values of CharLM's, under layers.* names
    """

    def __init__(
        self,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        seq_len: int = 64,
        lr: float = 1e-3,
        tied: bool = False,
        split_qkv: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # split_qkv: blocks that tensor parallelism can split (separate q, k, v; local heads)
        blocks = [(SplitQKVBlock if split_qkv else Block)(dim, heads) for _ in range(depth)]
        embedding, head = Embedding(256, dim, seq_len), nn.Linear(dim, 256, bias=not tied)
        if tied:  # as CharLM: the same network, its layers in one Sequential
            head.weight = embedding.tokens.weight
        self.layers = nn.Sequential(embedding, *blocks, nn.LayerNorm(dim), head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def stage_counts(self, num_stages: int) -> list[int]:
        """Layers per stage balanced by parameter count: what ``partition="parameters"`` chooses.

        Example::

            SequentialCharLM(depth=4).stage_counts(2)   # e.g. [3, 4]
        """
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in self.layers]
        return partition_balanced(sizes, num_stages)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class CharLM(NextByteLM):
    """The main job's model: a GPT in the usual layout, head tied to the token embedding, cosine LR decay.

    ``forward`` is what PipelineStrategy pipelines (traced with torch.export, split at the blocks of
    ``self.h``); :meth:`generate` samples text from the trained (consolidated) model.

    Example::

        model = CharLM(dim=128, depth=4)
        model.lm_head.weight is model.wte.weight            # True
        trainer.fit(model, StdlibText(64, 16, 2_000_000))
    """

    def __init__(
        self,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        seq_len: int = 64,
        lr: float = 1e-3,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(256, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, 256, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(_gpt_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def configure_optimizers(self) -> Any:
        return adamw_with_cosine_decay(self, self.hparams.get("warmup_steps", 0))

    @torch.no_grad()
    def generate(
        self, prompt: bytes, length: int, temperature: float = 0.8, top_k: int | None = None, seed: int = 0
    ) -> bytes:
        """Continue ``prompt`` by ``length`` bytes, sampling one at a time (on an unsplit model).

        A lower ``temperature`` and a ``top_k`` keep a small model to the bytes it is surest of.

        Example::

            CharLM.load_from_checkpoint("runs/charlm/last.ckpt").generate(b"def ", 200, 0.7, top_k=10)
        """
        generator = torch.Generator().manual_seed(seed)
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        self.eval()
        for _ in range(length):
            logits = self(idx[:, -self.hparams.seq_len :])[:, -1].float() / temperature
            if top_k is not None:
                kth = logits.topk(top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = logits.softmax(-1).cpu()
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator).to(idx.device)], 1)
        return bytes(idx[0].tolist())
