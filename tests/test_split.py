"""sources/sequential/split.py and stages.py, sources/materialize.py: the Sequential path, from finding the
Sequential to this rank's layers (one process)."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.pipeline.plan import make_plan
from lightning_parallel.sources.materialize import materialize
from lightning_parallel.sources.sequential.call import PipelinedSequential
from lightning_parallel.sources.sequential.split import (
    StageModule,
    check_parameters_inside,
    find_sequential,
    split_sequential,
    stage_descriptions,
    stage_parameters,
    stage_twins,
)
from lightning_parallel.sources.sequential.stages import SequentialStages
from lightning_parallel.sources.stage_shapes import ChainedShapes, run_on_fake


class TiedLM(nn.Module):
    """Embedding -> blocks -> head in one Sequential, the head's weight tied to the embedding."""

    def __init__(self, vocab=7, dim=4):
        super().__init__()
        head = nn.Linear(dim, vocab)
        self.layers = nn.Sequential(
            nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.LayerNorm(dim), nn.Tanh(), head
        )
        head.weight = self.layers[0].weight

    def forward(self, x):
        return self.layers(x)


def _plan(counts, pp_size):
    model = TiedLM()
    units, holds = stage_descriptions(model.layers, counts)
    params = [len(p) for p in stage_parameters(model, "layers", units)]
    return make_plan(units, holds, params, RankLayout(pp_size=pp_size, dp_size=1))


def test_find_sequential_takes_the_only_one_or_the_named_one():
    assert find_sequential(nn.Linear(2, 2)) is None
    model = TiedLM()
    assert find_sequential(model) == ("layers", model.layers)
    model.extra = nn.Sequential(nn.Tanh())
    with pytest.raises(
        ValueError, match=r"TiedLM has several top-level nn.Sequential children \(layers, extra\)"
    ):
        find_sequential(model)
    assert find_sequential(model, "extra") == ("extra", model.extra)
    model.head = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"module_name='head' names a Linear, not an nn.Sequential"):
        find_sequential(model, "head")
    with pytest.raises(ValueError, match=r"module_name='missing' names a NoneType"):
        find_sequential(model, "missing")


def test_parameters_outside_the_sequential_are_refused_by_name():
    model = TiedLM()
    check_parameters_inside(model, "layers")
    model.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(
        ValueError, match=r"outside the pipelined Sequential `layers`: scale\. .*`self\.layers`"
    ):
        check_parameters_inside(model, "layers")
    model.extra = nn.ModuleList(nn.Linear(1, 1) for _ in range(3))
    with pytest.raises(ValueError, match=r": scale, extra\.0\.weight, .*extra\.1\.bias \.\.\.\. Under"):
        check_parameters_inside(model, "layers")


def test_stage_descriptions_and_the_canonical_parameters_of_each_stage():
    model = TiedLM()
    units, holds = stage_descriptions(model.layers, [2, 3])
    assert units == [("0", "1"), ("2", "3", "4")]
    assert holds == ["0-1  (Embedding, Linear)", "2-4  (LayerNorm, Tanh, Linear)"]
    first, last = stage_parameters(model, "layers", units)
    assert first == {"layers.0.weight", "layers.1.weight", "layers.1.bias"}
    # The head reads the embedding's weight: the last stage lists it under its canonical name.
    assert last == {"layers.2.weight", "layers.2.bias", "layers.0.weight", "layers.4.bias"}


def test_a_stage_must_hand_tensors_to_the_next_one():
    class Pair(nn.Module):
        def forward(self, x):
            return x, 2 * x

    class Add(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    x = torch.ones(2)
    # A tuple sent between stages arrives as several arguments; the stage passes it on whole.
    torch.testing.assert_close(StageModule(OrderedDict({"0": Add()}), 1)(x, 2 * x), torch.full((2,), 3.0))
    out = StageModule(OrderedDict({"0": Pair()}), 0)(x)
    assert isinstance(out, tuple) and len(out) == 2

    class Mapping(nn.Module):
        def forward(self, x):
            return {"y": x}

    with pytest.raises(
        TypeError, match=r"pipeline stage 3 \(layers \['5', '6'\]\) returned a dict: .*partition"
    ):
        StageModule(OrderedDict({"5": nn.Identity(), "6": Mapping()}), 3)(x)
    with pytest.raises(TypeError, match="returned a tuple"):
        StageModule(OrderedDict({"0": nn.Identity()}), 0)(x, "not a tensor")


def test_split_keeps_only_this_ranks_layers_under_the_unsplit_keys():
    torch.manual_seed(0)
    model = TiedLM()
    unsplit = {k: v.clone() for k, v in model.state_dict().items()}
    plan = _plan([2, 3], pp_size=2)
    proxy, stages, indices = split_sequential(model, "layers", model.layers, plan, 1, torch.device("cpu"))
    assert model.layers is proxy and isinstance(proxy, PipelinedSequential) and indices == [1]
    assert [list(s._modules) for s in stages] == [["2", "3", "4"]] and stages[0].stage_index == 1
    kept = model.state_dict()
    assert list(kept) == ["layers.2.weight", "layers.2.bias", "layers.4.weight", "layers.4.bias"]
    for key, value in kept.items():
        assert torch.equal(value, unsplit[key])  # real tensors are kept as they are
    holder = SequentialStages(stages, indices, plan.num_stages, torch.device("cpu"), None)
    seen = []
    holder.each_stage(lambda stage: seen.extend(name for name, _ in stage.units))
    assert seen == ["2", "3", "4"]  # (named as the plan names them: no prefix given here)
    with pytest.raises(
        RuntimeError, match=r"holds only this rank's pipeline stage \(layers \['2', '3', '4'\]\)"
    ):
        model(torch.zeros(1, dtype=torch.long))


def test_a_meta_model_materialises_only_its_layers_and_keeps_the_tie():
    """pipeline_size=1 with two stages on the rank: both ends of the tie live here and share a tensor."""
    with torch.device("meta"):
        model = TiedLM()
    plan = _plan([2, 3], pp_size=1)
    _, _, indices = split_sequential(model, "layers", model.layers, plan, 0, torch.device("cpu"))
    assert indices == [0, 1]
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.layers._modules["4"].weight is model.layers._modules["0"].weight
    assert list(model.state_dict()) == list(TiedLM().state_dict())
    torch.testing.assert_close(model.layers._modules["2"].weight, torch.ones(4))  # reset_parameters ran

    with torch.device("meta"):
        model = TiedLM()
    split_sequential(model, "layers", model.layers, _plan([2, 3], pp_size=2), 0, torch.device("cpu"))
    assert list(model.state_dict()) == ["layers.0.weight", "layers.1.weight", "layers.1.bias"]
    assert not any(p.is_meta for p in model.parameters())


def test_materialize_reties_what_to_empty_unties_and_leaves_real_modules_alone():
    with torch.device("meta"):
        model = TiedLM()
    materialize(model, torch.device("cpu"))
    assert model.layers[4].weight is model.layers[0].weight and not model.layers[0].weight.is_meta
    torch.testing.assert_close(model.layers[2].weight, torch.ones(4))
    bound = 4**-0.5  # nn.Linear's init: uniform within 1/sqrt(fan_in)
    assert float(model.layers[1].bias.detach().abs().max()) <= bound

    real = TiedLM()
    before = {name: (p, p.clone()) for name, p in real.named_parameters()}
    materialize(real, torch.device("cpu"))
    for name, p in real.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1])


class ValueReader(nn.Module):
    """A layer that reads a tensor's value: it cannot run on fake tensors."""

    def forward(self, x):
        return x * float(x.abs().max().item() > 0)


def test_sequential_stages_are_sized_on_fake_tensors_of_the_real_device_for_every_shape():
    torch.manual_seed(0)
    model = TiedLM()
    plan = _plan([2, 3], pp_size=2)
    twins = stage_twins(model.layers, plan)
    assert all(p.is_meta for t in twins for p in t.parameters())
    assert twins[1]._modules["4"].weight is twins[0]._modules["0"].weight  # the tie, kept
    _, stages, indices = split_sequential(model, "layers", model.layers, plan, 1, torch.device("cpu"))
    holder = SequentialStages(stages, indices, plan.num_stages, torch.device("cpu"), None, twins)
    assert holder.needs_example
    for shape in [(3,), (5, 2), (3, 4)]:  # token ids of any shape: the stages' shapes follow
        tokens = torch.zeros(shape, dtype=torch.long)
        (in0, out0), (in1, out1) = holder._shapes(True, (tokens,))
        assert tuple(in0[0].shape) == shape and tuple(out0[0].shape) == (*shape, 4)
        assert (
            tuple(in1[0].shape) == (*shape, 4)
            and in1[0].requires_grad
            and tuple(out1[0].shape) == (*shape, 7)
        )
        assert all(t.is_meta for t in (*in0, *out0, *in1, *out1))
    # At the third shape the twins are exported once with dynamic sizes: a new shape runs nothing.
    assert isinstance(holder._chained[True], ChainedShapes)  # (exported at (3, 4): 2-D inputs only)
    assert holder._chained[True].examples((torch.zeros(7, dtype=torch.long),)) is None
    for shape in [(4, 3), (2, 9)]:
        tokens = torch.zeros(shape, dtype=torch.long)
        chained = holder._chained[True].examples((tokens,))
        fake = run_on_fake(twins, (tokens,), True, torch.device("cpu"))
        assert [[(t.shape, t.stride(), t.dtype, t.requires_grad) for t in (*i, *o)] for i, o in chained] == [
            [(t.shape, t.stride(), t.dtype, t.requires_grad) for t in (*i, *o)] for i, o in fake
        ]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts what the real stages would cast
        (_, out0), _ = holder._shapes(True, (torch.zeros(3, dtype=torch.long),))
    assert out0[0].dtype == torch.bfloat16
    warned = []
    fragile = SequentialStages(stages, indices, 2, torch.device("cpu"), None,
                               [nn.Sequential(ValueReader()), twins[1]], warn=warned.append)  # fmt: skip
    assert fragile._shapes(True, (torch.ones(3, 4),)) is None and not fragile.needs_example
    assert len(warned) == 1 and "could not run on fake tensors" in warned[0]
