"""Train a small character-level transformer language model on Python's own standard library.

The text is the ``.py`` sources that ship with the running Python (nothing to download). By default
2 CPU processes train with PipelineStrategy (2 stages); the same script runs on GPUs, with torchrun or
on SLURM. Copy it as a starting point: the model is an ordinary LightningModule whose layers sit in
one ``nn.Sequential``.

    python experiments/train_charlm.py                      # 2 processes, pipeline, a few minutes
    python experiments/train_charlm.py --strategy ddp       # 2 data-parallel processes
    python experiments/train_charlm.py --devices 1 --strategy auto
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_parallel import (
    AllReducedMetrics,
    GradientAccumulationScheduler,
    PipelineStrategy,
    Rank0Checkpoint,
)

# ------------------------------------------------------------------------------------------- data


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's .py sources, concatenated in a fixed order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibText(L.LightningDataModule):
    def __init__(self, seq_len: int, batch_size: int, max_bytes: int, val_fraction: float = 0.05) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.max_bytes, self.val_fraction = (
            seq_len,
            batch_size,
            max_bytes,
            val_fraction,
        )

    def setup(self, stage: str) -> None:
        data = torch.frombuffer(bytearray(stdlib_text(self.max_bytes)), dtype=torch.uint8)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.seq_len)
        self.val_set = ByteWindows(data[split:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


# ------------------------------------------------------------------------------------------ model


class Embedding(nn.Module):
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


class CharLM(L.LightningModule):
    """A byte-level transformer LM; its layers sit in one nn.Sequential, the part a pipeline splits."""

    def __init__(
        self, dim: int = 128, depth: int = 4, heads: int = 4, seq_len: int = 64, lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        blocks = [Block(dim, heads) for _ in range(depth)]
        self.layers = nn.Sequential(
            Embedding(256, dim, seq_len), *blocks, nn.LayerNorm(dim), nn.Linear(dim, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        steps = max(1, self.trainer.max_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


# ---------------------------------------------------------------------------------------- running


class Throughput(Callback):
    """Samples per second over the whole fit (all replicas), for the closing summary."""

    def __init__(self, global_batch_size: int) -> None:
        self.global_batch_size = global_batch_size
        self.start = self.seconds = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.seconds = time.perf_counter() - self.start

    def samples_per_second(self, steps: int) -> float:
        return steps * self.global_batch_size / max(self.seconds, 1e-9)


def make_strategy(args: argparse.Namespace):
    if args.strategy == "pipeline":
        return PipelineStrategy(
            num_stages=args.stages, num_microbatches=args.microbatches, schedule=args.schedule
        )
    return args.strategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs per node (default 2)")
    p.add_argument("--accelerator", default="cpu", help="cpu, gpu or auto (default cpu)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (torchrun / SLURM)")
    p.add_argument(
        "--strategy", default="pipeline", help="pipeline (default), ddp, auto, or any Lightning strategy name"
    )
    p.add_argument(
        "--stages", type=int, default=None, help="pipeline stages per replica (default: all devices)"
    )
    p.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per batch in the pipeline (default 4)"
    )
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b, ... (default 1f1b)")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=32,
        help="samples per optimizer step, all devices (default 32)",
    )
    p.add_argument(
        "--per-device-batch-size",
        type=int,
        default=None,
        help="samples per device per batch (default: global batch / replicas, no accumulation); "
        "GradientAccumulationScheduler accumulates to keep the global batch",
    )
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sample (default 64)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument(
        "--text-bytes", type=int, default=2_000_000, help="bytes of stdlib source to use (default 2 MB)"
    )
    p.add_argument(
        "--val-every", type=int, default=100, help="validate every N training batches (default 100)"
    )
    p.add_argument("--out", default="runs/charlm", help="where logs and checkpoints go (default runs/charlm)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def data_parallel_size(args: argparse.Namespace) -> int:
    world = args.devices * args.num_nodes
    if args.strategy == "pipeline":
        return world // (args.stages or world)
    return 1 if args.strategy in ("auto", "single_device") and args.devices == 1 else world


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    dp = data_parallel_size(args)
    if args.global_batch_size % dp:
        raise SystemExit(
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of the {dp} "
            f"data-parallel replicas"
        )
    per_device = args.per_device_batch_size or args.global_batch_size // dp
    throughput = Throughput(args.global_batch_size)
    checkpoint = Rank0Checkpoint(
        dirpath=os.path.join(args.out, "checkpoints"), monitor="val_loss", save_last=True, async_save=True
    )
    logger = CSVLogger(args.out, name="logs")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=make_strategy(args),
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=20,
        logger=logger,
        log_every_n_steps=10,
        callbacks=[
            GradientAccumulationScheduler(global_batch_size=args.global_batch_size),
            AllReducedMetrics(),
            checkpoint,
            throughput,
        ],
    )
    model = CharLM(dim=args.dim, depth=args.depth, seq_len=args.seq_len, lr=args.lr)
    trainer.fit(model, StdlibText(args.seq_len, per_device, args.text_bytes))
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(
            "\n=== run summary ===\n"
            f"strategy            {args.strategy} on {trainer.world_size} process(es), "
            f"{dp} data-parallel replica(s)\n"
            f"optimizer steps     {trainer.global_step} x {args.global_batch_size} samples\n"
            f"final train loss    {float(metrics.get('train_loss', float('nan'))):.4f}\n"
            f"final val loss      {float(metrics.get('val_loss', float('nan'))):.4f}\n"
            f"samples per second  {throughput.samples_per_second(trainer.global_step):.1f}\n"
            f"CSV log             {os.path.join(logger.log_dir, 'metrics.csv')}\n"
            f"checkpoint          {checkpoint.last_model_path or checkpoint.best_model_path}\n"
        )


if __name__ == "__main__":
    main()
