"""PipelineStrategy(data_parallel="fsdp") on the traced path (a nanoGPT-shaped module) against one device.

One spawned job of 4 gloo ranks runs each configuration in turn on the process group it set up.
"""

import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from mp_harness import assert_close_dicts, fit, quiet_trainer, reference_loader, spawn_gloo
from tiny_models import TinyGPT, loader, token_data

from lightning_parallel import PipelineStrategy
from lightning_parallel.parallelize.dtensors import full_tensors

WORLD = 4
DATA = token_data(44)  # the epoch ends on a short batch: traced again, the sharded root switches graphs
VAL = token_data(12, seed=1)
TRAIN = dict(max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2)
CONFIGS = {
    "fsdp-2x2": dict(pipeline_size=2, data_parallel="fsdp"),
    "hsdp-1x2x2": dict(pipeline_size=1, data_parallel="fsdp", data_parallel_shard_size=2, num_microbatches=2),
}


class Record(Callback):
    def __init__(self, path):
        self.path, self.losses, self.held = path, [], {}

    def on_train_start(self, trainer, pl_module):
        self.held = {n: type(p).__name__ for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_fit_end(self, trainer, pl_module):
        params = {k: v.detach().cpu() for k, v in full_tensors(pl_module.state_dict()).items()}
        val = float(trainer.callback_metrics.get("val_loss", float("nan")))
        torch.save({"losses": self.losses, "params": params, "held": self.held, "val": val}, self.path)


def _job(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for name, kwargs in CONFIGS.items():
        dp = world // kwargs["pipeline_size"]
        torch.manual_seed(0)
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(**{"num_microbatches": 4, **kwargs}),
            callbacks=[Record(f"{out_dir}/{name}-rank{rank}.pt")], **TRAIN,
        )  # fmt: skip
        trainer.fit(TinyGPT(), loader(DATA, 8 // dp), val_dataloaders=loader(VAL, 12 // dp))
    torch.save(None, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_traced_gpt_sharded_with_fsdp_matches_one_device(tmp_path):
    torch.manual_seed(0)
    ref = fit(
        TinyGPT(), reference_loader(DATA, 8), tmp_path / "ref", val_dataloaders=loader(VAL, 12), **TRAIN
    )[0]
    spawn_gloo(_job, WORLD, tmp_path)
    for name in CONFIGS:
        records = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
        params = {k: v for r in records for k, v in r["params"].items()}
        assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
        losses = torch.tensor([r["losses"] for r in records]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        # Every parameter each rank holds is a DTensor over its shards (the tied weight too).
        assert all(set(r["held"].values()) == {"DTensor"} for r in records), name
