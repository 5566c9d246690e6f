"""PipelineStrategy(tensor_parallel_size=...): tensor parallelism inside pipeline stages, against one device.

The multi-process configurations share one spawned job of 4 gloo ranks: each rank runs several
Trainers in turn on the process group the job set up (as under torchrun), so the imports are paid once.
"""

import os
import time

import pytest
import torch
from mp_harness import (
    GatheredRecorder,
    SaveAtEpochEnd,
    assert_close_dicts,
    fit,
    merged_records,
    quiet_trainer,
    reference_loader,
    spawn_gloo,
)
from tiny_models import TinyGPT, loader, token_data
from tiny_tp_models import SplitQkvGPT
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel import PipelineStrategy
from lightning_parallel.memory.config import ParallelConfig
from lightning_parallel.memory.estimate import predict
from lightning_parallel.memory.facts import measure_model
from lightning_parallel.parallelize.tensor import default_plan, user_plan
from lightning_parallel.strategies._pipeline_config import refuse_traced_parallelize
from lightning_parallel.strategies._pipeline_parallelize import tensor_plan

# 48 samples, global batch 16: 3 batches an epoch; accumulate_grad_batches=2 gives the windows [0, 1]
# and [2]: a full and a partial window per epoch. The clip value is below the gradient norm.
N_SAMPLES, GLOBAL_BATCH, WORLD = 48, 16, 4
TRAIN = dict(max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2)

# name -> (strategy kwargs, epochs). Run in this order inside the spawned job; the later runs resume
# the first run's checkpoint (saved at pp 2 x tp 2) at other shapes for epoch 2.
CONFIGS = {
    "pp2-tp2": (dict(pipeline_size=2, tensor_parallel_size=2), 2),
    "dp2-tp2-fsdp": (dict(pipeline_size=1, tensor_parallel_size=2, data_parallel="fsdp"), 2),
    "dp2-tp2-replicate": (dict(pipeline_size=1, tensor_parallel_size=2), 2),
}


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    data, ckpt = token_data(N_SAMPLES), f"{out_dir}/tp.ckpt"
    for name, (kwargs, epochs) in CONFIGS.items():
        dp = world // (kwargs["pipeline_size"] * kwargs["tensor_parallel_size"])
        torch.manual_seed(0)
        first = name == "pp2-tp2"
        record = GatheredRecorder(f"{out_dir}/{name}-rank{rank}.pt")
        callbacks = [record, *([SaveAtEpochEnd(ckpt)] if first else [])]
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(num_microbatches=4, **kwargs), callbacks=callbacks,
            limit_val_batches=2, **{**TRAIN, "max_epochs": epochs},
        )  # fmt: skip
        trainer.fit(
            SplitQkvGPT(), loader(data, GLOBAL_BATCH // dp),
            val_dataloaders=loader(data, GLOBAL_BATCH // dp) if first else None,
            ckpt_path=None if first else ckpt,
        )  # fmt: skip
    torch.save(None, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tensor_parallel_stages_match_one_device_and_resume_anywhere(tmp_path):
    torch.manual_seed(0)
    data = token_data(N_SAMPLES)
    ref = fit(SplitQkvGPT(), reference_loader(data, GLOBAL_BATCH), tmp_path / "ref", **TRAIN)[0]
    start = time.perf_counter()
    spawn_gloo(_job, WORLD, tmp_path)
    print(f"4-rank job: {time.perf_counter() - start:.1f} s")
    for name in CONFIGS:
        params, losses, _ = merged_records(tmp_path, name, WORLD)
        assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
        expected = torch.tensor(ref["losses"])[-len(losses) :]  # the resumed runs: their second epoch
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # pp 2 x tp 2: rank 0 (stage 0, tp rank 0) holds the first half of each split weight, as a DTensor.
    held = merged_records(tmp_path, "pp2-tp2", WORLD)[2]
    assert held[0]["held"]["layers.1.attn.q.weight"] == ("DTensor", "(Shard(dim=0),)", (8, 16))
    assert held[1]["held"]["layers.1.attn.proj.weight"] == ("DTensor", "(Shard(dim=1),)", (16, 8))
    assert held[0]["held"]["layers.0.wte.weight"][0] == "Parameter"  # the embedding stays whole
    # dp 2 (FSDP) x tp 2: a quarter of each split weight, sharded over dp on top of its tp slice (2-D).
    held = merged_records(tmp_path, "dp2-tp2-fsdp", WORLD)[2][0]["held"]["layers.1.attn.q.weight"]
    assert held == ("DTensor", "(_StridedShard(dim=0, sf=2), Shard(dim=0))", (4, 16)), held
    # The checkpoint saved at pp 2 x tp 2 resumes on one device.
    torch.manual_seed(0)
    one = fit(
        SplitQkvGPT(),
        reference_loader(data, GLOBAL_BATCH),
        tmp_path / "one",
        ckpt_path=tmp_path / "tp.ckpt",
        **TRAIN,
    )[0]
    assert_close_dicts(one["params"], ref["params"], rtol=1e-5, atol=1e-6)


def test_the_default_plan_splits_attention_and_mlp_and_divides_the_heads():
    plan = default_plan(SplitQkvGPT().layers, "layers", 2)
    assert {p: type(s).__name__ for p, s in plan.styles.items() if p.startswith("layers.1.")} == {
        "layers.1.attn.q": "ColwiseParallel", "layers.1.attn.k": "ColwiseParallel",
        "layers.1.attn.v": "ColwiseParallel", "layers.1.attn.proj": "RowwiseParallel",
        "layers.1.mlp.fc": "ColwiseParallel", "layers.1.mlp.proj": "RowwiseParallel",
    }  # fmt: skip
    assert plan.head_counts == {"layers.1.attn": {"heads": 2}, "layers.2.attn": {"heads": 2}}


def test_blocks_the_default_plan_cannot_split_are_named():
    with pytest.raises(
        ValueError, match=r"`layers.1.attn` \(Attention\) has heads=4, which tensor_parallel_size=3"
    ):
        default_plan(SplitQkvGPT().layers, "layers", 3)
    fused = TinyGPT().h[0]  # nanoGPT's attention: one qkv Linear
    with pytest.raises(
        ValueError, match=r"`layers.0.attn` \(CausalSelfAttention\) projects q, k and v with one fused"
    ):
        default_plan(nn.Sequential(fused), "layers", 2)
    unknown = nn.Sequential(nn.Embedding(5, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    with pytest.raises(
        ValueError, match=r"does not know how to split `layers.1` \(Sequential\).*\['layers.1.0'\]"
    ):
        default_plan(unknown, "layers", 2)
    with pytest.raises(ValueError, match="found no attention or MLP block"):
        default_plan(nn.Sequential(nn.Linear(4, 4)), "layers", 2)


def test_a_user_plan_is_matched_by_pattern_and_checked():
    seq = SplitQkvGPT().layers
    plan = user_plan(
        seq, "layers", 2, {"layers.*.mlp.fc": ColwiseParallel(), "layers.*.mlp.proj": RowwiseParallel()}
    )
    assert sorted(plan.styles) == [
        "layers.1.mlp.fc",
        "layers.1.mlp.proj",
        "layers.2.mlp.fc",
        "layers.2.mlp.proj",
    ]
    with pytest.raises(ValueError, match=r"pattern 'layers.\*.ffn' matches no module"):
        user_plan(seq, "layers", 2, {"layers.*.ffn": ColwiseParallel()})
    with pytest.raises(TypeError, match="ParallelStyle instances"):
        user_plan(seq, "layers", 2, {"layers.1.mlp.fc": "colwise"})


def test_tensor_parallel_options_are_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        PipelineStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="but tensor_parallel_size=1"):
        PipelineStrategy(tensor_parallel_plan={"layers.1": ColwiseParallel()})
    with pytest.raises(ValueError, match="data_parallel='zero1' is not supported"):
        PipelineStrategy(tensor_parallel_size=2, data_parallel="zero1")
    with pytest.raises(TypeError, match="tensor_parallel_plna"):
        PipelineStrategy(tensor_parallel_plna={})


def test_the_traced_path_refuses_tensor_parallelism_with_the_reason():
    config = PipelineStrategy(pipeline_size=1, tensor_parallel_size=2).config
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 needs the stage modules of a split nn.Sequential"
    ):
        refuse_traced_parallelize(config)
    assert tensor_plan(TinyGPT(), config) is None  # no Sequential: the traced path's refusal speaks


def test_the_planner_measures_one_tensor_parallel_rank_s_local_model():
    model, batch = SplitQkvGPT(), token_data(8)[:8]
    whole = predict(measure_model(model, batch), ParallelConfig("pipeline", 2, 2, 2))
    split = predict(
        measure_model(model, batch, tensor_parallel_size=2),
        ParallelConfig("pipeline", 4, 2, 2, tensor_parallel_size=2),
    )
    # Stage 0 holds the embedding (whole) and two blocks: their q, k, v, fc weights and biases, and the
    # weights of both output projections, halve; the norms and the projections' biases stay whole.
    block = model.layers[1]
    halved = sum(p.numel() for n, p in block.named_parameters() if "ln" not in n and n != "attn.proj.bias")
    halved -= block.mlp.proj.bias.numel()
    assert whole.ranks[0].parameters - split.ranks[0].parameters == 2 * 4 * halved // 2  # fp32 bytes
    assert split.config.label() == "pp 2x1 1f1b m=2 tp=2"
    with pytest.raises(ValueError, match="measured for tensor_parallel_size=1 but the config asks 2"):
        predict(measure_model(model, batch), ParallelConfig("pipeline", 4, 2, 2, tensor_parallel_size=2))
