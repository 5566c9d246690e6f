"""PipelineStrategy(tensor_parallel_size=...): tensor parallelism inside pipeline stages, what only it has.

The plans (default, a user's, a Hugging Face model's own, the traced path's) and their refusals, the
planner's local model, and one spawned job of 4 gloo ranks: Hugging Face decoders split with their own
plan, fp16 on the traced stages' DTensor gradients, an overflow in one shard, Megatron's collectives.
Every configuration with the other techniques (pipeline x tensor x data parallel, FSDP2, recomputation,
the looped and V placements, both stage sources, resumes at another shape and on one device) is a case
of the configuration matrix (tests/matrix.py, run by tests/test_matrix.py), with tensor parallelism's
own check there (the split layers held as DTensors sharded over the tensor-parallel ranks).
"""

import os

import hf_env
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from mp_harness import (
    GatheredRecorder,
    assert_close_dicts,
    fit,
    merged_records,
    quiet_trainer,
    reference_loader,
    spawn_gloo,
)
from tiny_models import TinyGPT, loader, token_data
from tiny_tp_models import SplitQkvGPT, SplitQkvTinyGPT
from torch import nn
from torch.distributed.pipelining._IR import _modify_graph_op_device
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_parallel import PipelineStrategy
from lightning_parallel.grads.loss_scale import agree_on_overflow
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import measure_model, planned_tensors
from lightning_parallel.sources.traced.source import TracedSource
from lightning_parallel.sources.traced.stage_graphs import graph_modules, point_at
from lightning_parallel.sources.traced.trace import trace
from lightning_parallel.sources.twin import alias_table, meta_twin, to_meta
from lightning_parallel.strategies.pipeline.build import source_for
from lightning_parallel.techniques.tensor_parallel import technique as tensor_parallel
from lightning_parallel.techniques.tensor_parallel.apply import apply_held_styles
from lightning_parallel.techniques.tensor_parallel.memory import local_model
from lightning_parallel.techniques.tensor_parallel.plan import default_plan, user_plan
from lightning_parallel.techniques.tensor_parallel.traced import (
    TensorParallelGraph,
    TensorParallelStep,
    place_split_ops,
    register_missing_shardings,
)

# Hugging Face decoders from config (the family begins the name), split with their own
# base_model_tp_plan: (tied, how the step calls it, strategy kwargs), two optimizer steps each. GPT-NeoX
# splits its fused query_key_value column-wise (its rows are grouped by head), with partial rotary.
HF_CONFIGS = {
    "llama-tied-masked-pp2-tp2": (True, "masked", dict(pipeline_size=2, tensor_parallel_size=2)),
    "neox-untied-logits-pp2-tp2": (False, "logits", dict(pipeline_size=2, tensor_parallel_size=2)),
    "llama-untied-labels-dp2-tp2-fsdp": (
        False,
        "labels",
        dict(pipeline_size=1, tensor_parallel_size=2, data_parallel="fsdp"),
    ),
}
HF_STEPS, WORLD, GLOBAL_BATCH = 2, 4, 16
DATA = token_data(48)


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for name, (tied, call, kwargs) in HF_CONFIGS.items():
        dp = world // (kwargs["pipeline_size"] * kwargs["tensor_parallel_size"])
        trainer = quiet_trainer(
            devices=world, strategy=PipelineStrategy(num_microbatches=2, **kwargs), max_steps=HF_STEPS,
            callbacks=[GatheredRecorder(f"{out_dir}/{name}-rank{rank}.pt")],
        )  # fmt: skip
        trainer.fit(_hf_model(name, tied, call), loader(_hf_data(call), 8 // dp))
    trainer = quiet_trainer(
        devices=world, strategy=PipelineStrategy(num_microbatches=2, pipeline_size=2, tensor_parallel_size=2),
        callbacks=[GatheredRecorder(f"{out_dir}/traced-pp2-tp2-16-mixed-rank{rank}.pt")], **FP16_TRAIN,
        **_fp16(),
    )  # fmt: skip
    trainer.fit(_seeded_traced(), loader(DATA, GLOBAL_BATCH))
    torch.save(
        {**_megatron_collectives(), "overflow": _overflow_in_one_shard(rank)}, f"{out_dir}/rank{rank}.pt"
    )


# fp16 with a GradScaler (its scale doubling every 2 clean steps) on the traced stages' DTensor gradients.
# Tensor parallelism sums each row-wise projection in two fp16 halves: close to one device, not equal.
FP16_TRAIN = dict(max_epochs=2, gradient_clip_val=0.5)


def _fp16() -> dict:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=2)
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler)])


def _seeded_traced():
    torch.manual_seed(0)
    return SplitQkvTinyGPT()


def _hf_model(name: str, tied: bool, call: str):
    from hf_models import HFCausalLM  # (skips where transformers is missing, outside CI)

    torch.manual_seed(0)  # 2 blocks: one a stage at pp 2 (the export and the cut cost per block traced)
    return HFCausalLM(name.split("-")[0], tied=tied, call=call, lr=1e-3, layers=2)


def _hf_data(call: str):
    from hf_models import hf_token_data

    return hf_token_data(16, padded=call == "masked")


def _overflow_in_one_shard(rank: int) -> tuple[bool, float, float]:
    """fp16 under tensor parallelism: an inf in one rank's shard of a split gradient skips every rank's
    step. Each rank unscales its DTensor and plain gradients; returns (found_inf, a plain gradient and a
    split one after unscaling)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    split, whole = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    parallelize_module(split, tp, ColwiseParallel())
    for p in (split.weight, whole.weight):
        p.grad = torch.full_like(p, 8.0)
    if rank == 1:
        split.weight.grad.to_local()[0, 0] = float("inf")  # tp rank 1 of the first replica only
    optimizer = torch.optim.SGD([split.weight, whole.weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    agree_on_overflow(scaler)
    scaler.scale(torch.ones(()))  # (the scale is made at the first scale())
    scaler.unscale_(optimizer)
    found = next(iter(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()))
    return bool(found.item()), whole.weight.grad[0, 0].item(), split.weight.grad.to_local()[-1, -1].item()


def _megatron_collectives() -> dict[str, dict[str, int]]:
    """The collectives of one traced stage split over 2 tensor-parallel ranks (forward, backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    model, x = SplitQkvTinyGPT(depth=2), torch.randint(0, 13, (2, 8))
    plan = tensor_plan(model, PipelineStrategy(tensor_parallel_size=2).parallel_plan)
    aliases = alias_table(model)
    gm = trace(meta_twin(model), to_meta((x,)), [], train=True).get_stage_module(0)
    _modify_graph_op_device(gm, torch.device("cpu"))  # the twin was traced on the meta device
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    held = apply_held_styles(model, plan, tp)
    register_missing_shardings()
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    point_at(gm, {aliases.get(n, n): t for n, t in tensors}, aliases)
    assert place_split_ops(graph_modules(gm), held, aliases) == set(held)
    counts = {}
    with TensorParallelStep():
        with CommDebugMode() as forward:
            out = TensorParallelGraph(gm, tp, [m for _, m in graph_modules(gm)])(x)
        with CommDebugMode() as backward:
            out.square().sum().backward()
    for name, mode in (("forward", forward), ("backward", backward)):
        counts[name] = {str(op).rpartition(".")[2]: n for op, n in mode.get_comm_counts().items()}
    return counts


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_hugging_face_plans_fp16_on_traced_graphs_and_megatron_s_collectives(tmp_path):
    """What only tensor parallelism has (its configurations with the other techniques are cases of the
    configuration matrix, tests/test_matrix.py): Hugging Face decoders split with their own
    base_model_tp_plan against one device, the traced GPT's DTensor gradients under a GradScaler, an inf
    in one rank's shard skipping every rank's step, and a traced stage's collectives."""
    hf_refs = {
        name: fit(_hf_model(name, tied, call), reference_loader(_hf_data(call), 8),
                  tmp_path / name, devices=1, max_steps=HF_STEPS)[0]
        for name, (tied, call, _) in HF_CONFIGS.items()
    }  # fmt: skip
    collectives = spawn_gloo(_job, WORLD, tmp_path)
    fp16_ref = fit(_seeded_traced(), reference_loader(DATA, GLOBAL_BATCH), tmp_path / "ref-fp16",
                   **FP16_TRAIN, **_fp16())[0]  # fmt: skip
    params, losses, _ = merged_records(tmp_path, "traced-pp2-tp2-16-mixed", WORLD)
    torch.testing.assert_close(losses, torch.tensor(fp16_ref["losses"]), rtol=2e-3, atol=2e-3)
    assert_close_dicts(params, fp16_ref["params"], rtol=1e-2, atol=1e-3)
    for name in HF_CONFIGS:
        params, losses, _ = merged_records(tmp_path, name, WORLD)
        assert_close_dicts(params, hf_refs[name]["params"], rtol=1e-5, atol=1e-5)
        expected = torch.tensor(hf_refs[name]["losses"])
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    held = merged_records(tmp_path, "llama-tied-masked-pp2-tp2", WORLD)[2][1]["held"]  # stage 0, tp rank 1
    assert held["model.model.layers.0.self_attn.k_proj.weight"] == ("DTensor", "(Shard(dim=0),)", (8, 32))
    assert held["model.model.layers.0.mlp.down_proj.weight"] == ("DTensor", "(Shard(dim=1),)", (32, 32))
    # A traced stage split over 2 ranks costs Megatron's collectives: per block, one all-reduce after
    # the attention and one after the MLP in forward, one for each block input's gradient in backward.
    for counts in collectives:
        overflow = counts.pop("overflow")
        assert overflow == (True, 2.0, 2.0), overflow  # every rank found it; 8 / 4 unscaled in place
        assert counts == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}, counts


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


def test_the_traced_path_plans_the_block_list_and_refuses_what_it_cannot_place():
    config = PipelineStrategy(pipeline_size=1, tensor_parallel_size=2).parallel_plan
    model = SplitQkvTinyGPT()
    assert isinstance(source_for(model, config), TracedSource)
    plan = tensor_plan(model, config)
    assert plan.head_counts == {}  # a traced stage's DTensors keep the global shapes
    assert {p: type(s).__name__ for p, s in plan.styles.items() if p.startswith("h.1.")} == {
        "h.1.attn.q": "ColwiseParallel", "h.1.attn.k": "ColwiseParallel", "h.1.attn.v": "ColwiseParallel",
        "h.1.attn.proj": "RowwiseParallel", "h.1.mlp.fc": "ColwiseParallel",
        "h.1.mlp.proj": "RowwiseParallel",
    }  # fmt: skip
    with pytest.raises(
        ValueError, match=r"`h.0.attn` \(CausalSelfAttention\) projects q, k and v with one fused"
    ):
        tensor_plan(TinyGPT(), config)
    with pytest.raises(
        ValueError, match=r"`h.0.attn` \(Attention\) has heads=4, which tensor_parallel_size=3"
    ):
        tensor_plan(
            SplitQkvTinyGPT(), PipelineStrategy(pipeline_size=1, tensor_parallel_size=3).parallel_plan
        )
    sequence = PipelineStrategy(tensor_parallel_size=2, tensor_parallel_plan={"ln_f": SequenceParallel()})
    with pytest.raises(
        ValueError, match=r"`ln_f` is split with SequenceParallel, but a traced forward takes"
    ):
        tensor_plan(SplitQkvTinyGPT(), sequence.parallel_plan)


def test_a_hugging_face_model_is_split_with_its_own_plan():
    hf_env.require("transformers")
    from hf_models import HFCausalLM, hf_config

    config = PipelineStrategy(tensor_parallel_size=2).parallel_plan
    plan = tensor_plan(HFCausalLM("llama"), config)
    assert {p: type(s).__name__ for p, s in plan.styles.items() if ".layers.3." in p} == {
        f"model.model.layers.3.{p}": style
        for p, style in (
            ("self_attn.q_proj", "ColwiseParallel"), ("self_attn.k_proj", "ColwiseParallel"),
            ("self_attn.v_proj", "ColwiseParallel"), ("self_attn.o_proj", "RowwiseParallel"),
            ("mlp.gate_proj", "ColwiseParallel"), ("mlp.up_proj", "ColwiseParallel"),
            ("mlp.down_proj", "RowwiseParallel"),
        )
    }  # fmt: skip
    four = PipelineStrategy(tensor_parallel_size=4).parallel_plan  # 2 key/value heads
    with pytest.raises(ValueError, match="config has num_key_value_heads=2, which tensor_parallel_size=4"):
        tensor_plan(HFCausalLM("llama"), four)
    gpt2 = HFCausalLM("gpt2")  # no base_model_tp_plan, and Conv1D layers: the default plan finds nothing
    assert hf_config("gpt2").base_model_tp_plan is None
    with pytest.raises(
        ValueError, match=r"found no attention or MLP block to split in `model\.transformer\.h`"
    ):
        tensor_plan(gpt2, config)


def test_the_planner_measures_one_tensor_parallel_rank_s_local_model():
    model, batch = SplitQkvGPT(), token_data(8)[:8]
    whole = predict(measure_model(model, batch), ParallelPlan("pipeline", 2, 2, 2))
    split = predict(
        measure_model(model, batch, tensor_parallel_size=2),
        ParallelPlan("pipeline", 4, 2, 2, tensor_parallel_size=2),
    )
    # Stage 0 holds the embedding (whole) and two blocks: their q, k, v, fc weights and biases, and the
    # weights of both output projections, halve; the norms and the projections' biases stay whole.
    block = model.layers[1]
    halved = sum(p.numel() for n, p in block.named_parameters() if "ln" not in n and n != "attn.proj.bias")
    halved -= block.mlp.proj.bias.numel()
    assert whole.ranks[0].parameters - split.ranks[0].parameters == 2 * 4 * halved // 2  # fp32 bytes
    assert split.plan.label() == "pp 2x1 1f1b m=2 tp=2"
    with pytest.raises(ValueError, match="measured for tensor_parallel_size=1 but the config asks 2"):
        predict(measure_model(model, batch), ParallelPlan("pipeline", 4, 2, 2, tensor_parallel_size=2))


def test_the_planner_measures_a_traced_model_s_local_model():
    model, batch = SplitQkvTinyGPT(), token_data(8)[:8]
    local = local_model(model, planned_tensors(model, 2), 2)
    assert local.h[0].attn.heads == 2 and local.h[0].attn.q.out_features == 8  # (of 4 heads, width 16)
    assert local.h[0].mlp.proj.in_features == 32 and local.lm_head.weight is local.wte.weight
    whole = predict(measure_model(model, batch), ParallelPlan("pipeline", 1, 1, 2))
    split = predict(measure_model(model, batch, tensor_parallel_size=2), ParallelPlan("pipeline", 2, 1, 2,
                    tensor_parallel_size=2))  # fmt: skip
    halved = sum(
        p.numel() for b in model.h for n, p in b.named_parameters() if "ln" not in n and "proj.bias" not in n
    )
    assert whole.ranks[0].parameters - split.ranks[0].parameters == 4 * halved // 2  # fp32 bytes


def tensor_plan(module, plan):
    """The tensor-parallel plan the strategy resolves on the unsplit module (as the source splits it)."""
    return tensor_parallel.TECHNIQUE.before_split(plan, source_for(module, plan).unsplit(module))
