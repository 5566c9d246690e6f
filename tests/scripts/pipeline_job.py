"""A user's script with PipelineStrategy's default launcher, for torchrun and the subprocess launcher.

torchrun --nnodes 2 --nproc-per-node 1 ... pipeline_job.py --out DIR --num-nodes 2 --devices 1
python pipeline_job.py --out DIR --devices 2 --mode predict
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L
import torch
from mp_harness import RankRecorder
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import PipelineStrategy


class FailingRegressor(SequentialRegressor):
    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == self.fail_rank:
            raise RuntimeError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["fit", "predict"], default="fit")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--fail-rank", type=int, default=None, help="raise in training_step on this rank")
    args = p.parse_args()
    torch.manual_seed(0)
    model = FailingRegressor(args.fail_rank) if args.fail_rank is not None else SequentialRegressor()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
        strategy=PipelineStrategy(pipeline_size=2, num_microbatches=4), max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RankRecorder(args.out)],
    )  # fmt: skip
    if args.mode == "fit":
        trainer.fit(model, loader(regression_data(), 16))
    else:
        predictions = trainer.predict(model, loader(regression_data(23, seed=1), 5))
        if trainer.is_global_zero:
            torch.save(
                {"predictions": predictions, "weights": model.state_dict()}, os.path.join(args.out, "pred.pt")
            )


if __name__ == "__main__":
    main()
