"""pp 2 x dp 2 (FSDP) x tp 2 and HSDP x tp 2 against one device: 8 processes, by hand (not in the suite).

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/scripts/tensor_parallel_8_ranks.py

The Sequential GPT (one epoch, accumulation and clipping), the traced GPT (the same) and a Hugging Face
Llama from config split with its own plan (two steps) at pp 2 x dp 2 x tp 2; the traced GPT as one
stage, 2 replicas x 2 shards x 2 tp ranks (HSDP): losses and every gathered parameter to 1e-5.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hf_env  # noqa: F401  (.hf_packages on the path)
from mp_harness import (
    GatheredRecorder,
    assert_close_dicts,
    fit,
    merged_records,
    quiet_trainer,
    reference_loader,
    spawn_gloo,
)
from tiny_models import loader, token_data
from tiny_tp_models import SplitQkvGPT, SplitQkvTinyGPT

from lightning_parallel import PipelineStrategy

TRAIN = dict(max_epochs=1, gradient_clip_val=0.5, accumulate_grad_batches=2)
HF_STEPS = 2


def _llama():
    from hf_models import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM("llama", tied=True, call="masked", lr=1e-3)


def _gpt(cls):
    torch.manual_seed(0)
    return cls()


def _hf_data():
    from hf_models import hf_token_data

    return hf_token_data(16, padded=True)


PP2_DP2_TP2 = dict(pipeline_size=2, tensor_parallel_size=2, data_parallel="fsdp")
HSDP_TP2 = dict(pipeline_size=1, tensor_parallel_size=2, data_parallel="fsdp", data_parallel_shard_size=2)
# name -> (model factory, data, global batch, Trainer arguments, strategy arguments, data-parallel size)
RUNS = {
    "sequential": (lambda: _gpt(SplitQkvGPT), lambda: token_data(48), 16, TRAIN, PP2_DP2_TP2, 2),
    "traced": (lambda: _gpt(SplitQkvTinyGPT), lambda: token_data(48), 16, TRAIN, PP2_DP2_TP2, 2),
    "llama": (_llama, _hf_data, 8, dict(max_steps=HF_STEPS), PP2_DP2_TP2, 2),
    # HSDP x tp: 2 replicas x 2 shards x 2 tp ranks, one stage
    "traced-hsdp": (lambda: _gpt(SplitQkvTinyGPT), lambda: token_data(48), 16, TRAIN, HSDP_TP2, 4),
}


def job(rank, world, out):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for name, (model, data, batch, train, kwargs, dp) in RUNS.items():
        strategy = PipelineStrategy(num_microbatches=4 if kwargs["pipeline_size"] > 1 else 2, **kwargs)
        record = GatheredRecorder(f"{out}/{name}-rank{rank}.pt")
        t = quiet_trainer(devices=world, strategy=strategy, callbacks=[record], **train)
        t.fit(model(), loader(data(), batch // dp))
    torch.save(None, f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    out = tempfile.mkdtemp()
    refs = {
        name: fit(model(), reference_loader(data(), batch), f"{out}/ref-{name}", devices=1, **train)[0]
        for name, (model, data, batch, train, *_) in RUNS.items()
    }
    start = time.perf_counter()
    spawn_gloo(job, 8, out)
    print(f"8-rank job: {time.perf_counter() - start:.1f} s")
    for name in RUNS:
        params, losses, records = merged_records(Path(out), name, 8)
        assert_close_dicts(params, refs[name]["params"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(losses, torch.tensor(refs[name]["losses"]), rtol=1e-5, atol=1e-6)
        held = records[0]["held"]
        split = next(v for k, v in held.items() if v[0] == "DTensor" and "q" in k.split(".")[-2])
        print(f"{name}: {RUNS[name][4]} equals one device; a q weight held as {split}; losses "
              f"{losses.tolist()}")  # fmt: skip
