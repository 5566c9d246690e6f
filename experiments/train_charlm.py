"""Train a small character-level GPT on Python's own standard library, pipelined over 2 processes.

The text is the ``.py`` sources that ship with the running Python (nothing to download). By default
2 CPU processes train with PipelineStrategy (2 stages); the same script runs on GPUs, with torchrun or
on SLURM. Copy it (with ``models.py``, which holds the model and the data) as a starting point: the
model is an ordinary GPT (a ModuleList of blocks, head tied to the embedding) that knows nothing of
the pipeline; PipelineStrategy traces its forward and splits it at the blocks. At the end rank 0 loads
the consolidated checkpoint into a plain model and prints a short text sample.

At the end, rank 0 prints a summary and writes it as JSON (``--summary``, default
``<out>/summary.json``): final train and validation loss, samples per second, wall time, and where the
log and the checkpoint went. Other scripts (``scaling_charlm.py``) read that file.

The defaults fit about 3.5 minutes on 2 CPU cores: a narrow, shallow GPT (width 64, one block per
stage) taking many small steps (8 samples of 128 bytes, 2 micro-batches) at a high learning rate (1e-2
after 100 warm-up steps) learns far more in that time than a larger one taking fewer, larger steps
(width 128, 4 blocks, 32 samples of 64 bytes at 2e-3 ended at 2.68 nats/byte, and its sample was noise).

    python experiments/train_charlm.py                      # 2 processes, pipeline, ~3.5 minutes
    python experiments/train_charlm.py --strategy ddp       # 2 data-parallel processes
    python experiments/train_charlm.py --devices 1 --strategy auto
    python experiments/train_charlm.py --refresh-docs .     # then quote the run in README.md, docs/demo.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _demo_summary import SAMPLE_PROMPT, refresh_docs, summary_lines
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from models import CharLM, StdlibText, stdlib_text, unigram_bits_per_byte
from typing_extensions import override

from lightning_parallel import (
    AllReducedMetrics,
    GradientAccumulationScheduler,
    PipelineStrategy,
    Rank0Checkpoint,
)

# ---------------------------------------------------------------------------------------- running


class Throughput(Callback):
    """Samples per second over the whole fit (all replicas), for the closing summary."""

    def __init__(self, global_batch_size: int) -> None:
        self.global_batch_size = global_batch_size
        self.start = self.seconds = 0.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start

    def samples_per_second(self, steps: int) -> float:
        return steps * self.global_batch_size / max(self.seconds, 1e-9)


class StepProgressBar(RichProgressBar):
    """Lightning's progress bar, counting optimizer steps out of ``max_steps``, without ``v_num``.

    Given ``max_steps`` only, Lightning 2.6 sets ``max_epochs`` to -1, and its bar reads "Epoch 0/-2"
    over the epoch's batches; it also shows the CSV log's version (``v_num: 0.000``), which says nothing
    about the run. Here it reads "Steps" and, e.g., ``120/1700``: the optimizer steps so far out of
    the run's, as ``--max-steps`` counts them (also when batches are accumulated).
    """

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)

    def _show_steps(self, trainer: L.Trainer) -> None:
        if self.progress is None or self.train_progress_bar_id is None or trainer.max_steps < 0:
            return
        description = f"{'Steps':{len(self.validation_description)}}"  # as wide: no flicker
        self.progress.update(
            self.train_progress_bar_id,
            description=description,
            completed=trainer.global_step,
            total=trainer.max_steps,
        )
        self.refresh()

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the log's version, not the run's progress
        return items


def progress_bar() -> ProgressBar | None:
    """The steps bar where ``rich`` is installed (``make demo`` installs it); else Lightning's default."""
    return StepProgressBar() if importlib.util.find_spec("rich") is not None else None


def hide_lightning_deprecations() -> None:
    """Hide the two FutureWarnings that Lightning 2.6.6 raises under torch 2.13, in this script only.

    They come from Lightning's own code, not from this script or the package's API, so a user has
    nothing to change: ``isinstance(treespec, LeafSpec)`` (Lightning's ``utilities/_pytree.py`` builds a
    ``LeafSpec``) and ``torch.distributed.nn.functional.all_gather`` (Lightning's ``strategy.all_gather``,
    which GradientAccumulationScheduler calls once as training starts); each rank printed them. Filtered
    by their exact messages, in this script's processes (each rank runs ``main``), not at import of the
    package: another script still sees them, and any other warning still shows.
    """
    for message in (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def make_strategy(args: argparse.Namespace) -> Any:
    if args.strategy == "pipeline":
        return PipelineStrategy(
            pipeline_size=args.stages, num_microbatches=args.microbatches, schedule=args.schedule
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
        "--microbatches", type=int, default=2, help="micro-batches per batch in the pipeline (default 2)"
    )
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b, ... (default 1f1b)")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=8,
        help="samples per optimizer step, all devices (default 8: many small steps teach a small model "
        "more than a few large ones in the same time)",
    )
    p.add_argument(
        "--per-device-batch-size",
        type=int,
        default=None,
        help="samples per device per batch (default: global batch / replicas, no accumulation); "
        "GradientAccumulationScheduler accumulates to keep the global batch",
    )
    p.add_argument(
        "--max-steps", type=int, default=1700, help="optimizer steps (default 1700: ~3.5 min on 2 cores)"
    )
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sample (default 128)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--depth", type=int, default=2, help="transformer blocks (default 2: one per stage)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=100,
        help="optimizer steps of linear LR warm-up before the cosine decay (default 100)",
    )
    p.add_argument(
        "--text-bytes", type=int, default=2_000_000, help="bytes of stdlib source to use (default 2 MB)"
    )
    p.add_argument(
        "--val-every", type=int, default=425, help="validate every N training batches (default 425)"
    )
    p.add_argument("--out", default="runs/charlm", help="where logs and checkpoints go (default runs/charlm)")
    p.add_argument(
        "--summary", type=Path, default=None, help="the JSON summary to write (default <out>/summary.json)"
    )
    p.add_argument(
        "--sample-bytes",
        type=int,
        default=300,
        help="bytes of text to generate at the end (0: none; default 300)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature of the sample (default 0.8)"
    )
    p.add_argument("--top-k", type=int, default=5, help="sample among the k likeliest bytes only (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--refresh-docs",
        type=Path,
        default=None,
        metavar="ROOT",
        help="then quote this run in ROOT's README.md and docs/demo.md (the repository's: .)",
    )
    args = p.parse_args(argv)
    if args.temperature <= 0:
        p.error(f"--temperature ({args.temperature}) must be positive: e.g. 0.8")
    if args.top_k is not None and not 1 <= args.top_k <= 256:
        p.error(f"--top-k ({args.top_k}) must be between 1 and 256, the bytes there are")
    return args


def data_parallel_size(args: argparse.Namespace) -> int:
    world = args.devices * args.num_nodes
    if args.strategy == "pipeline":
        return world // (args.stages or world)
    return 1 if args.strategy in ("auto", "single_device") and args.devices == 1 else world


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write the run's summary as JSON, whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)


def summarise(
    args: argparse.Namespace, trainer: L.Trainer, throughput: Throughput, paths: dict[str, str], wall: float
) -> dict[str, Any]:
    """The run's numbers and files, as the JSON summary holds them."""
    metrics = trainer.callback_metrics
    return {
        "strategy": args.strategy,
        "processes": trainer.world_size,
        "data_parallel": data_parallel_size(args),
        "optimizer_steps": trainer.global_step,
        "global_batch_size": args.global_batch_size,
        "samples": trainer.global_step * args.global_batch_size,
        "train_loss": float(metrics.get("train_loss", float("nan"))),
        "val_loss": float(metrics.get("val_loss", float("nan"))),
        "val_bits_per_byte": float(metrics.get("val_loss", float("nan"))) / math.log(2),
        "unigram_bits_per_byte": unigram_bits_per_byte(stdlib_text(args.text_bytes)),
        "samples_per_s": throughput.samples_per_second(trainer.global_step),
        "fit_seconds": throughput.seconds,
        "wall_s": wall,
        "load_avg_1min": args.load_avg_1min,
        "threads_per_process": torch.get_num_threads(),
        **paths,
    }


def print_summary(summary: dict[str, Any], path: Path) -> None:
    print("\n" + "\n".join(summary_lines(summary, path)) + "\n")


def sample_text(checkpoint: str, args: argparse.Namespace) -> str:
    """Text generated by the consolidated checkpoint, loaded into a plain (unsplit) model."""
    if not checkpoint or args.sample_bytes <= 0:
        return ""
    model = CharLM.load_from_checkpoint(checkpoint, map_location="cpu")
    text = model.generate(SAMPLE_PROMPT, args.sample_bytes, args.temperature, args.top_k, seed=args.seed)
    return text.decode("utf-8", errors="replace")


def build_trainer(args: argparse.Namespace, logger: CSVLogger, callbacks: list[Callback]) -> L.Trainer:
    """The Trainer of the main job: the package's callbacks for an exact global batch and metrics."""
    return L.Trainer(
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
            *callbacks,
            *filter(None, [progress_bar()]),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    args.load_avg_1min = os.getloadavg()[0]  # the machine's load as the run starts, for the docs' quote
    hide_lightning_deprecations()
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
    trainer = build_trainer(args, logger, [checkpoint, throughput])
    model = CharLM(
        dim=args.dim, depth=args.depth, seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps
    )
    trainer.fit(model, StdlibText(args.seq_len, per_device, args.text_bytes))
    if not trainer.is_global_zero:
        return
    paths = {
        "log_csv": os.path.join(logger.log_dir, "metrics.csv"),
        "checkpoint": checkpoint.last_model_path or checkpoint.best_model_path,
        "out": str(args.out),
    }
    summary = summarise(args, trainer, throughput, paths, time.perf_counter() - started)
    summary["sample"] = sample_text(paths["checkpoint"], args)
    summary_path = args.summary or Path(args.out) / "summary.json"
    write_summary(summary_path, summary)
    print_summary(summary, summary_path)
    if args.refresh_docs:
        refresh_docs(args.refresh_docs, summary)


if __name__ == "__main__":
    main()
