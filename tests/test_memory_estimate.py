"""The memory planner's logic without processes: units, probe, optimizer state, per-rank arithmetic.

Covers planner/stage_costs.py (each stage's parameters, in-flight and received bytes, the too-many-stages
error) through predict, techniques/offload/memory.py as the planner composes it (each rank's device and
host bytes under offload) and
_table.py's format_bytes (which planner/estimate.py re-exports).
"""

import dataclasses

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from tiny_models import DeviceAwareGPT, SequentialRegressor
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import PipelineStrategy, estimate_memory
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import format_bytes, predict
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import given_links
from lightning_parallel.planner.optimizer import StateSize, optimizers_from, state_sizes
from lightning_parallel.planner.precision import LOSS_SCALER_BYTES
from lightning_parallel.planner.probe import probe_activations, probe_sizes
from lightning_parallel.planner.ranking import (
    candidate_plans,
    fastest_fit,
    format_plan,
    host_per_node,
    rank_plans,
)
from lightning_parallel.planner.resolve import resolve
from lightning_parallel.planner.search import Search
from lightning_parallel.planner.units import find_units
from lightning_parallel.techniques.zero import shard_sizes


class TinyGPT(nn.Module):
    """GPT-shaped: embeddings, a ModuleList of blocks, final norm and a head tied to the embedding."""

    def __init__(self, vocab=32, dim=16, depth=4, seq=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = x + block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _gpt_batch(n=8):
    x = torch.randint(0, 32, (n, 9))
    return x[:, :-1], x[:, 1:]


# ------------------------------------------------------------------------------------------ units


def test_units_of_a_sequential_are_its_layers():
    layout = find_units(SequentialRegressor(depth=4))
    assert layout.kind == "sequential"
    assert [u.name for u in layout.units] == ["layers.0", "layers.1", "layers.2", "layers.3"]


def test_a_gpt_shaped_model_puts_embeddings_first_and_the_head_last():
    facts = measure_model(TinyGPT(), _gpt_batch())
    roles = [(u.name, u.role) for u in facts.layout.units]
    assert roles == [("wte", "pre"), ("wpe", "pre"), *[(f"h.{i}", "block") for i in range(4)],
                     ("ln_f", "post"), ("lm_head", "post")]  # fmt: skip


def test_a_model_without_units_is_refused():
    with pytest.raises(ValueError, match=r"Linear has no pipeline units: put its layers in one top-level"):
        find_units(nn.Linear(2, 2))


class _Layers(nn.Module):
    """Three layers, called in order: in a top-level Sequential (``whole=False``) or as attributes."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)]
        if whole:
            self.fc1, self.act, self.fc2 = layers
        else:
            self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x) if hasattr(self, "layers") else self.fc2(self.act(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_a_model_with_nothing_to_split_is_sized_whole_on_one_stage():
    layout = find_units(_Layers(whole=True))
    assert (layout.kind, layout.max_stages) == ("whole", 1)
    assert [u.name for u in layout.units] == ["fc1", "act", "fc2"]
    assert "no pipeline units" in layout.describe() and "pipeline_size=1 plans only" in layout.describe()
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    # Sized as the same layers in a Sequential on one stage: replicas, ZeRO-1 with recomputation, offload.
    for strategy in (PipelineStrategy(pipeline_size=1, num_microbatches=2),
                     PipelineStrategy(pipeline_size=1, data_parallel="zero1", activation_checkpointing=True),
                     PipelineStrategy(pipeline_size=1, offload="optimizer")):  # fmt: skip
        whole = estimate_memory(_Layers(whole=True), batch, devices=2, strategy=strategy)
        split = estimate_memory(_Layers(whole=False), batch, devices=2, strategy=strategy)
        assert [dataclasses.astuple(r) for r in whole.ranks] == [dataclasses.astuple(r) for r in split.ranks]
    with pytest.raises(
        ValueError, match=r"2 pipeline stages .* no pipeline units .*: use pipeline_size=1, or"
    ):
        estimate_memory(_Layers(whole=True), batch, devices=2, strategy=PipelineStrategy(pipeline_size=2))


# ------------------------------------------------------------------------------------------ probe


def test_probe_charges_each_saved_tensor_to_its_layer_and_scales_with_the_batch():
    model = _mlp()
    probe = probe_activations(model, find_units(model), torch.randn(32, 8), probe_sizes(32))
    # Linear saves its input (8 floats a sample); Tanh its output (16); the second Linear's input is
    # that same output, already counted.
    assert probe.unit("0").saved.at(32) == 32 * 8 * 4
    assert probe.unit("1").saved.at(32) == 32 * 16 * 4
    assert probe.unit("2").saved.at(32) == 0
    assert probe.unit("1").saved_output.at(32) == 32 * 16 * 4  # Tanh saved its own output
    assert probe.unit("0").saved_input.at(32) == 32 * 8 * 4
    assert probe.unit("2").outputs.at(10) == 10 * 4 * 4


def test_a_batch_the_model_rejects_gets_a_clear_error():
    model = _mlp()
    with pytest.raises(ValueError, match=r"Sequential rejected the batch \(tensor shapes \[\(2, 5\)\]"):
        estimate_memory(model, torch.randn(8, 5), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_probe_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate_memory(model, torch.randn(8, 4), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------------------------ optimizer


def test_optimizer_state_is_learnt_from_the_optimizer():
    p = [nn.Parameter(torch.zeros(10))]
    assert state_sizes([torch.optim.AdamW(p)])[id(p[0])] == StateSize(8, 4)  # 2 fp32 moments + step
    assert state_sizes([torch.optim.SGD(p, lr=0.1, momentum=0.9)])[id(p[0])] == StateSize(4, 0)
    assert state_sizes([torch.optim.SGD(p, lr=0.1)])[id(p[0])] == StateSize(0, 0)
    assert state_sizes([torch.optim.Adam(p)], torch.bfloat16)[id(p[0])] == StateSize(4, 4)


def test_configure_optimizers_return_shapes():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    for config in (opt, [opt], ([opt], [sched]), {"optimizer": opt, "lr_scheduler": sched}):
        assert optimizers_from(config) == [opt]


def test_a_module_whose_configure_optimizers_needs_a_trainer_asks_for_optimizer():
    class NeedsTrainer(TinyGPT):
        def configure_optimizers(self):
            raise RuntimeError("TinyGPT is not attached to a `Trainer`.")

    with pytest.raises(
        ValueError, match=r"configure_optimizers\(\) failed outside a Trainer .*pass optimizer="
    ):
        estimate_memory(NeedsTrainer(), _gpt_batch())


# ------------------------------------------------------------------------------------- arithmetic


def test_ddp_rank_holds_parameters_gradients_state_buckets_and_activations():
    model = _mlp()
    est = estimate_memory(
        model, torch.randn(32, 8), devices=4, optimizer=torch.optim.AdamW(model.parameters())
    )
    rank = est.worst
    n_params = 8 * 16 + 16 + 16 * 4 + 4
    assert rank.parameters == rank.gradients == rank.buffers == 4 * n_params  # buffers: DDP's buckets
    assert rank.optimizer == 8 * n_params + 4 * 4
    saved = 32 * (8 + 16) * 4
    assert rank.activations == saved + 2 * 32 * 16 * 4  # + the backward transient (2 x largest saved)
    assert est.peak == rank.parameters + rank.gradients + rank.optimizer + rank.activations + rank.buffers


def _deep_facts(precision="32-true"):
    torch.manual_seed(0)
    model = SequentialRegressor(d_in=16, hidden=64, depth=8, adam=True)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32  # (the inputs as the Trainer's)
    batch = (torch.randn(32, 16, dtype=dtype), torch.randn(32, 4, dtype=dtype))
    return measure_model(model, batch, precision)


def test_pipeline_in_flight_follows_the_schedule_and_gpipe_holds_more():
    facts = _deep_facts()
    one_f_one_b = predict(facts, ParallelPlan("pipeline", 4, 4, 8, "1f1b"))
    gpipe = predict(facts, ParallelPlan("pipeline", 4, 4, 8, "gpipe"))
    assert [r.in_flight for r in one_f_one_b.ranks] == [(4,), (3,), (2,), (1,)]
    assert [r.in_flight for r in gpipe.ranks] == [(8,)] * 4
    assert gpipe.ranks[0].activations > 1.5 * one_f_one_b.ranks[0].activations
    # Each stage holds its parameters only: together the model, once.
    assert sum(r.parameters for r in gpipe.ranks) == sum(t.nbytes for t in facts.tensors.values())


def test_a_pipeline_rank_holds_one_gradient_and_all_of_it_inside_an_accumulation_window():
    facts = _deep_facts()
    step = predict(facts, ParallelPlan("pipeline", 4, 4, 8, "1f1b"))
    window = predict(facts, ParallelPlan("pipeline", 4, 4, 8, "1f1b", accumulate_grad_batches=4))
    for one, acc in zip(step.ranks, window.ranks):
        # The previous step's gradients are released before the schedule: never more than the stage's.
        assert 0 < one.gradients <= one.parameters
        # Inside a window the schedule adds into the window's gradients, there from the start.
        assert acc.gradients == acc.parameters and acc.peak >= one.peak
        assert acc.activations + acc.buffers <= one.activations + one.buffers + one.gradients
    with pytest.raises(ValueError, match="accumulate_grad_batches must be a positive int"):
        ParallelPlan("pipeline", 4, 4, 8, "1f1b", accumulate_grad_batches=0)


def _wide_facts():
    """Blocks much wider inside than at their boundary: what recomputation is for."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 16))  # noqa: E731
    model = nn.Sequential(*[block() for _ in range(8)])
    return measure_model(model, torch.randn(32, 16), optimizer=torch.optim.AdamW(model.parameters()))


def test_recomputation_and_sharding_shrink_their_components():
    facts = _wide_facts()
    base = predict(facts, ParallelPlan("pipeline", 4, 2, 4, "1f1b"))
    ac = predict(facts, ParallelPlan("pipeline", 4, 2, 4, "1f1b", activation_checkpointing=True))
    zero = predict(facts, ParallelPlan("pipeline", 4, 2, 4, "1f1b", data_parallel="zero1"))
    assert ac.ranks[0].activations < 0.6 * base.ranks[0].activations
    assert (ac.ranks[0].parameters, ac.ranks[0].optimizer) == (
        base.ranks[0].parameters,
        base.ranks[0].optimizer,
    )
    assert zero.ranks[0].activations == base.ranks[0].activations
    # ZeRO: the fuller of the two replicas, tensors placed as torch places them.
    stage0 = [facts.tensors[k] for unit in ("0", "1", "2", "3") for k in facts.unit_params[unit]]
    shares = shard_sizes([[t.numel for t in stage0]], 2)
    assert zero.ranks[0].optimizer == 8 * max(shares) + 4 * len(stage0) // 2
    assert zero.ranks[0].optimizer < 0.6 * base.ranks[0].optimizer


def test_compiled_stages_are_modelled_as_eager_and_the_table_says_so():
    facts = _wide_facts()
    eager = predict(facts, resolve(PipelineStrategy(pipeline_size=2), 2, "32-true"))
    compiled = predict(facts, resolve(PipelineStrategy(pipeline_size=2, compile=True), 2, "32-true"))
    assert compiled.plan.compiled and not eager.plan.compiled
    assert [r.peak for r in compiled.ranks] == [r.peak for r in eager.ranks]
    table = compiled.format_table()
    assert table.startswith("pp 2x1 1f1b m=4 +compile") and "modelled as eager" in table
    assert "modelled as eager" not in eager.format_table()


def test_fsdp_shards_parameters_and_state_and_gathers_the_stage_for_the_step():
    facts = _wide_facts()  # Linear(16, 128) and Linear(128, 16): 128 and 16 rows
    base = predict(facts, ParallelPlan("pipeline", 4, 2, 4, "1f1b"))
    fsdp = predict(facts, ParallelPlan("pipeline", 4, 2, 4, "1f1b", data_parallel="fsdp"))
    hsdp = predict(facts, ParallelPlan("pipeline", 8, 2, 4, data_parallel="fsdp", data_parallel_shard_size=2))
    zero = predict(facts, ParallelPlan("pipeline", 4, 2, 4, "1f1b", data_parallel="zero1"))
    for b, f, h in zip(base.ranks, fsdp.ranks, hsdp.ranks):
        # Each of 2 shards holds half of every tensor's rows (all even here): half the parameters and
        # half of the state per element (AdamW: 8 bytes); the per-tensor ``step`` stays whole.
        assert f.parameters * 2 == b.parameters and f.gathered == b.parameters
        stage = b.parameters // 4  # elements
        tensors = (b.optimizer - 8 * stage) // 4
        assert f.optimizer == 8 * stage // 2 + 4 * tensors
        assert (f.gradients, f.activations, f.buffers) == (b.gradients, b.activations, b.buffers)
        assert f.peak == b.peak + b.parameters // 2 - (b.optimizer - f.optimizer)  # shard + gathered
        assert h == f  # HSDP 2 replicas x 2 shards: each rank as FSDP over 2
    assert fsdp.peak > zero.peak  # under a pipeline the gathered stage outweighs the sharded state
    assert "gathered" in fsdp.format_table() and "gathered" not in base.format_table()
    # A row count the shards do not divide: the first shard holds the rounded-up rows (FSDP2's chunks).
    odd = measure_model(nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3)), torch.randn(2, 4),
                        optimizer=torch.optim.SGD([torch.zeros(1)]))  # fmt: skip
    three = predict(odd, ParallelPlan("pipeline", 6, 2, 1, data_parallel="fsdp"))
    assert three.ranks[0].parameters == 4 * (2 * 4 + 2) and three.ranks[1].parameters == 4 * (1 * 5 + 1)
    config = resolve(
        PipelineStrategy(pipeline_size=2, data_parallel="fsdp", data_parallel_shard_size=2), 8, "32-true"
    )
    assert (config.data_parallel, config.shard_size, config.label()) == (
        "fsdp",
        2,
        "pp 2x4 1f1b m=4 +hsdp 2x2",
    )
    with pytest.raises(ValueError, match=r"data_parallel_shard_size \(3\) does not divide the 4"):
        ParallelPlan("pipeline", 8, 2, data_parallel="fsdp", data_parallel_shard_size=3)
    with pytest.raises(ValueError, match="data_parallel='fsdp' shards the stages of a pipeline"):
        ParallelPlan("ddp", 2, data_parallel="fsdp")
    with pytest.raises(ValueError, match="unknown data_parallel='zero3'"):
        ParallelPlan("pipeline", 2, 2, data_parallel="zero3")
    assert ParallelPlan("pipeline", 4, 2, data_parallel="zero1").data_parallel == "zero1"
    assert ParallelPlan("pipeline", 4, 2, data_parallel="zero1").shard_optimizer_state
    labels = {c.label() for c in candidate_plans(4, 8, 32, layout="sequential")}
    assert "pp 2x2 1f1b m=4 +fsdp" in labels and "pp 4x1 1f1b m=4 +fsdp" not in labels


def test_bf16_mixed_saves_smaller_activations_and_counts_weight_copies():
    fp32, bf16 = _deep_facts(), _deep_facts("bf16-mixed")
    config = ParallelPlan("pipeline", 2, 2, 4, "1f1b")
    a32 = predict(fp32, config).ranks[0]
    a16 = predict(bf16, ParallelPlan("pipeline", 2, 2, 4, "1f1b", precision="bf16-mixed")).ranks[0]
    assert a16.parameters == a32.parameters  # fp32 master weights
    assert sum(u.weight_copies for u in bf16.probe.units.values()) > 0  # autocast's bf16 copies
    assert sum(u.weight_copies for u in fp32.probe.units.values()) == 0
    with pytest.raises(ValueError, match="measured in '32-true' but the config asks 'bf16-mixed'"):
        predict(fp32, ParallelPlan("pipeline", 2, 2, 4, precision="bf16-mixed"))


def test_16_mixed_saves_as_much_as_bf16_mixed_and_adds_the_loss_scalers_state():
    bf16, fp16 = _deep_facts("bf16-mixed"), _deep_facts("16-mixed")
    for shape in (("ddp", 2), ("pipeline", 2, 2, 4, "1f1b"), ("pipeline", 4, 2, 4, "1f1b")):
        b = predict(bf16, ParallelPlan(*shape, precision="bf16-mixed"))
        h = predict(fp16, ParallelPlan(*shape, precision="16-mixed", data_parallel="zero1"))
        b_zero = predict(bf16, ParallelPlan(*shape, precision="bf16-mixed", data_parallel="zero1"))
        for rb, rz, rh in zip(b.ranks, b_zero.ranks, h.ranks):
            # Same-size half-precision activations and weight copies; fp32 weights, gradients and state.
            assert (rh.parameters, rh.gradients, rh.activations) == (
                rb.parameters,
                rb.gradients,
                rb.activations,
            )
            assert (
                rh.optimizer == rz.optimizer + LOSS_SCALER_BYTES["16-mixed"]
            )  # on every rank, even with ZeRO


def test_tied_weights_are_held_by_every_stage_that_uses_them():
    model = TinyGPT()
    facts = measure_model(model, _gpt_batch())
    est = predict(facts, ParallelPlan("pipeline", 2, 2, 2, "1f1b"))
    embedding = model.wte.weight.numel() * 4
    assert est.ranks[0].parameters >= embedding and est.ranks[1].parameters >= embedding
    held = est.ranks[0].parameters + est.ranks[1].parameters
    assert held == sum(t.nbytes for t in facts.tensors.values()) + embedding


def test_more_stages_than_layers_is_a_clear_error():
    facts = measure_model(_mlp(), torch.randn(8, 8), optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"4 pipeline stages .* the model has 3 layers in ``: use at most 3"):
        predict(facts, ParallelPlan("pipeline", 4, 4, 4))


def test_a_pipeline_strategy_carries_its_plan():
    strategy = PipelineStrategy(
        pipeline_size=2, num_microbatches=8, schedule="gpipe", shard_optimizer_state=True,
        activation_checkpointing=["layers.1"],
    )  # fmt: skip
    config = resolve(strategy, devices=4, precision="bf16-mixed")
    assert (config.pipeline_size, config.data_parallel_size, config.num_microbatches) == (2, 2, 8)
    assert config.activation_checkpointing == ("layers.1",) and config.shard_optimizer_state
    assert config.label() == "pp 2x2 gpipe m=8 +ac +zero"
    with pytest.raises(ValueError, match=r"pipeline_size \(3\) does not divide devices x nodes \(4\)"):
        ParallelPlan("pipeline", 4, 3)


# ---------------------------------------------------------------------------------------- planner


def test_planner_table_marks_what_fits_and_the_fastest():
    model = SequentialRegressor(d_in=16, hidden=64, depth=8, adam=True)
    facts = measure_model(model, (torch.randn(32, 16), torch.randn(32, 4)), time_sizes=(2, 8))
    search = Search(devices=4, global_batch_size=32)
    plans = search.plans(num_blocks=8)
    assert {c.pipeline_size for c in plans} == {1, 2, 4} and all(c.strategy == "pipeline" for c in plans)
    ranked = rank_plans(facts, plans, search, given_links(bandwidth=10e9, latency=1e-5))
    assert all(c.time is not None and c.time.seconds > 0 for c in ranked)
    assert [c.seconds / c.samples for c in ranked] == sorted(c.seconds / c.samples for c in ranked)
    budget = sorted(c.peak for c in ranked)[len(ranked) // 2]
    best = fastest_fit(ranked, budget)
    assert best is not None and best.peak <= budget
    assert all(c.seconds >= best.seconds for c in ranked if c.peak <= budget)
    table = format_plan(ranked, budget)
    assert table.count("<- chosen") == 1 and "no" in table and "yes" in table
    assert fastest_fit(ranked, 1) is None


def test_offload_moves_state_or_activations_to_the_host_and_the_node_counts_its_ranks():
    facts = _deep_facts()
    plain = predict(facts, ParallelPlan("pipeline", 4, 2, 4))
    optimizer = predict(facts, ParallelPlan("pipeline", 4, 2, 4, offload="optimizer"))
    activations = predict(facts, ParallelPlan("pipeline", 4, 2, 4, offload="activations"))
    fsdp = predict(facts, ParallelPlan("pipeline", 4, 2, 4, data_parallel="fsdp"))
    fsdp_off = predict(facts, ParallelPlan("pipeline", 4, 2, 4, data_parallel="fsdp", offload="parameters"))
    for p, o, a, f, fo in zip(plain.ranks, optimizer.ranks, activations.ranks, fsdp.ranks, fsdp_off.ranks):
        assert p.host == 0 and o.optimizer == 0 and o.peak == p.peak - p.optimizer
        # The host: a copy of the trainable parameters, the gradients and the optimizer state.
        assert o.host == p.parameters + p.gradients + p.optimizer
        # On the device: a micro-batch's saved tensors only while its backward runs.
        assert a.host > 0 and a.activations <= p.activations and a.parameters == p.parameters
        assert fo.parameters == 0 and fo.optimizer == 0 and fo.gathered == f.gathered
        assert fo.host == f.parameters + f.optimizer + fo.gradients // 2  # the shards (2 ranks) on the host
        assert o.total == o.peak + o.host
    assert activations.ranks[0].activations < plain.ranks[0].activations  # (2 micro-batches in flight)
    # 4 ranks, pp 2 x dp 2: ranks 0, 1 (stage 0) on node 0, ranks 2, 3 (stage 1) on node 1.
    assert host_per_node(optimizer, 2) == 2 * max(r.host for r in optimizer.ranks)
    assert host_per_node(optimizer, 4) == 2 * sum(r.host for r in optimizer.ranks)
    assert "peak (device)" in optimizer.format_table() and "host" in optimizer.format_table()


def test_the_disk_tier_moves_the_state_to_the_disk_the_host_holds_its_buffer():
    """``offload_to="disk"``: the state (its ZeRO-1 share; bf16 parameters' fp32 masters with it) in the
    disk column, the host holding the buffer only (the slots and work area the tier sizes for the rank's
    share: 3 slots of a chunk's state and a work area of its gradients, parameters and their rounding,
    under the 64 MiB bound), per rank and per node; the table shows both."""
    disk = dict(offload="optimizer", offload_to="disk", offload_dir="/nvme", offload_buffer="64MiB")
    # (replicas: the whole state on every rank; ZeRO-1: each replica's share)
    for precision, data_parallel in (
        ("32-true", "replicate"),
        ("32-true", "zero1"),
        ("bf16-true", "replicate"),
    ):
        facts = _deep_facts(precision)
        shape = dict(devices=4, pipeline_size=2, num_microbatches=4, data_parallel=data_parallel)
        plain = predict(facts, ParallelPlan(**shape))
        on_disk = predict(facts, ParallelPlan(**shape, **disk))
        for p, d in zip(plain.ranks, on_disk.ranks):
            state, work = (8, 8) if precision == "32-true" else (12, 10)  # bytes an element: slot, work
            assert d.optimizer == 0 and d.peak == p.peak - p.optimizer and d.host < 64 * 2**20
            assert d.host == pytest.approx(d.disk * (3 * state + work) / state, rel=0.01)
            if precision == "32-true":
                assert d.disk == pytest.approx(p.optimizer, abs=1), data_parallel
            else:  # AdamW's bf16 state (2 + 2 bytes an element) in fp32 in the files, an fp32 master beside
                elements = p.parameters // 2
                assert d.disk == pytest.approx(p.optimizer + (8 - 4 + 4) * elements, rel=0.01)
        assert host_per_node(on_disk, 4) == 2 * sum(d.host for d in on_disk.ranks)  # (2 replicas a node)
        header = on_disk.format_table().splitlines()[1]
        assert "peak (device)" in header and "host" in header and "disk" in header


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 * 2**20, 24 * 2**30)] == ["512 B", "2.00 KiB", "3.00 MiB",
                                                                            "24.00 GiB"]  # fmt: skip


# ---------------------------------------------------------------------------------- one device


def test_one_device_models_the_trainer_without_ddp_and_says_so():
    model = _mlp()
    batch, optimizer = torch.randn(32, 8), torch.optim.AdamW(model.parameters())
    single = estimate_memory(model, batch, optimizer=optimizer)  # "auto": what Trainer(devices=1) runs
    ddp = estimate_memory(model, batch, strategy="ddp", optimizer=optimizer)
    assert single.plan.strategy == "single_device" and single.worst.buffers == 0  # no gradient buckets
    assert ddp.peak - single.peak == ddp.worst.buffers == ddp.worst.gradients
    assert single.format_table().startswith("single device (32-true)")
    assert ddp.format_table().startswith("ddp x1 (32-true)")
    assert resolve("auto", 4, "32-true").strategy == "ddp"
    with pytest.raises(ValueError, match=r"'single_device' runs on one device, got devices=2"):
        resolve("single_device", 2, "32-true")


class _StepMeter(L.Callback):
    """torch's MemTracker around the second training step: its peak bytes."""

    peak = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.tracker = MemTracker()
            self.tracker.track_external(pl_module, *trainer.optimizers, batch)
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.tracker.__exit__(None, None, None)
            snapshot = self.tracker.get_tracker_snapshot("peak")
            self.peak = int(sum(device.get("Total", 0) for device in snapshot.values()))


def test_one_device_estimate_is_within_15_percent_of_memtracker_under_trainer_devices_1():
    torch.manual_seed(0)
    model = SequentialRegressor(d_in=256, hidden=256, d_out=256, depth=4, adam=True)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    predicted = estimate_memory(model, (x, y)).peak
    meter = _StepMeter()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[meter],
    )  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(x.repeat(2, 1), y.repeat(2, 1)), batch_size=64))
    assert meter.peak > 0 and abs(predicted / meter.peak - 1) <= 0.15, (predicted, meter.peak)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_model_on_the_meta_device_is_measured_as_on_the_device_it_runs_on(precision):
    """The probe runs a meta model on fake tensors of this machine's device (here the CPU): the forward
    enters ``torch.autocast(x.device.type, enabled=False)`` (no ``meta`` autocast exists) and takes the
    CPU's attention branch, and bf16-mixed casts as on the CPU; the figures are the real model's."""
    tokens = torch.randint(0, 13, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = (tokens, tokens.roll(1, 1))
    torch.manual_seed(0)
    real = estimate_memory(DeviceAwareGPT(), batch, devices=2, strategy="pipeline", precision=precision)
    with torch.device("meta"):
        meta_model = DeviceAwareGPT()
    meta = estimate_memory(meta_model, batch, devices=2, strategy="pipeline", precision=precision)
    assert [dataclasses.astuple(r) for r in meta.ranks] == [dataclasses.astuple(r) for r in real.ranks]
    assert all(t.is_meta for t in meta_model.parameters())  # nothing was allocated or left behind
