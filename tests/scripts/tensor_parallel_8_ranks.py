"""pp 2 x dp 2 (FSDP) x tp 2 against one device: 8 processes, run by hand (~140 s on 2 loaded cores).

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/scripts/tensor_parallel_8_ranks.py

One epoch with accumulation and clipping; losses and every gathered parameter to 1e-5.
"""

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mp_harness import assert_close_dicts, fit, quiet_trainer, reference_loader, spawn_gloo
from test_pipeline_tensor import Record
from tiny_models import loader, token_data
from tiny_tp_models import SplitQkvGPT

from lightning_parallel import PipelineStrategy

TRAIN = dict(max_epochs=1, gradient_clip_val=0.5, accumulate_grad_batches=2)


def job(rank, world, out):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    torch.manual_seed(0)
    t = quiet_trainer(
        devices=world,
        strategy=PipelineStrategy(
            pipeline_size=2, tensor_parallel_size=2, data_parallel="fsdp", num_microbatches=4
        ),
        callbacks=[Record(f"{out}/r-rank{rank}.pt")],
        **TRAIN,
    )
    t.fit(SplitQkvGPT(), loader(token_data(48), 8))
    torch.save(None, f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    out = tempfile.mkdtemp()
    torch.manual_seed(0)
    ref = fit(SplitQkvGPT(), reference_loader(token_data(48), 16), f"{out}/ref", **TRAIN)[0]
    start = time.perf_counter()
    spawn_gloo(job, 8, out)
    print(f"8-rank job: {time.perf_counter() - start:.1f} s")
    recs = [torch.load(f"{out}/r-rank{r}.pt", weights_only=False) for r in range(8)]
    params = {k: v for r in recs for k, v in r["params"].items()}
    assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
    losses = torch.tensor([r["losses"] for r in recs]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    print(
        "pp2 x dp2 (fsdp) x tp2 equals one device:",
        recs[0]["held"]["layers.1.attn.q.weight"],
        losses.tolist(),
    )
