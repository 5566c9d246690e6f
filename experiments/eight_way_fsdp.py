"""The guide's 8-GPU layout, run for real on 8 CPU processes: 2 pipeline stages x 4 FSDP2 shards.

Exactly docs/pipeline.md's example (``accelerator="cpu"`` in place of ``"gpu"``)::

    Trainer(devices=8, strategy=PipelineStrategy(pipeline_size=2, data_parallel="fsdp"))

with a small GPT in one ``nn.Sequential`` (``models.SequentialCharLM``: embeddings, 4 blocks, final
norm, head) for a few steps. The 8 processes are the harness's (``h.spawn``, as torchrun would start
them: the Trainer joins them). Global rank 0 prints the stage table as the strategy logs it at start;
then every rank reports the parameter bytes it really holds (its local shards), which must equal the
table's "per rank" column, and the loss of the last step.

Usage::

    python experiments/eight_way_fsdp.py            # ~1 minute on 2 cores (8 processes)
    python experiments/eight_way_fsdp.py --quick    # 4 processes (2 stages x 2 shards), one step
"""

from __future__ import annotations

import logging

import _harness as h
import lightning as L
import torch
import torch.distributed as dist
from models import ByteWindows, SequentialCharLM
from torch.utils.data import DataLoader

from lightning_parallel import PipelineStrategy
from lightning_parallel._table import format_bytes
from lightning_parallel.distributed.dtensors import local

DEVICES, STEPS, BATCH_PER_REPLICA, SEQ_LEN = 8, 3, 8, 32


class ReportShards(L.Callback):
    """Every rank's parameter bytes (its local shards) and the last loss, printed by global rank 0."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = sum(local(p).untyped_storage().nbytes() for p in pl_module.parameters())
        every: list = [None] * trainer.world_size
        dist.all_gather_object(every, (trainer.global_rank, held))
        plan = trainer.strategy.plan
        if trainer.global_rank == 0:
            expected = {r: s.bytes_per_rank for s in plan.stages for r in s.ranks}
            for rank, nbytes in every:
                ok = "=" if nbytes == expected[rank] else "!="
                print(f"rank {rank}: holds {format_bytes(nbytes)} of parameters {ok} the table's per rank")
            assert all(n == expected[r] for r, n in every), "a rank holds other bytes than the table says"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            loss = trainer.callback_metrics.get("train_loss")
            print(f"trained {trainer.global_step} steps; last loss {float(loss):.4f}")


def worker(rank: int, world: int, steps: int) -> None:
    # The strategy's start-up lines (the stage table) as a script shows them; h.spawn quiets Lightning.
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = SequentialCharLM(dim=64, depth=4, heads=4, seq_len=SEQ_LEN)
    data = ByteWindows.of_stdlib(steps * BATCH_PER_REPLICA * world // 2, SEQ_LEN)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=PipelineStrategy(pipeline_size=2, data_parallel="fsdp"),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ReportShards()],
    )
    trainer.fit(model, DataLoader(data, batch_size=BATCH_PER_REPLICA, drop_last=True))


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__, repeats=None).parse_args(argv)  # (--out-dir: it writes no file)
    h.spawn(worker, 4 if args.quick else DEVICES, 1 if args.quick else STEPS)


if __name__ == "__main__":
    main()
