"""pipeline/state.py: stage optimizer states merged into one file, and resharded on load (pure logic)."""

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.state import (
    check_keys,
    merge_optimizer_states,
    named_optimizer_state,
    reshard_optimizer_state,
    to_cpu,
)


class TiedNet(nn.Module):
    """emb -> mid -> norm -> head, with head.weight tied to emb.weight (as in a language model)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.norm(self.mid(self.emb(x))))


ORDER = ["emb.weight", "mid.weight", "mid.bias", "norm.weight", "norm.bias"]
# Two stages as the strategy splits them: the tied weight has one (canonical) name on both.
STAGE_NAMES = [
    {"emb": "emb.weight", "mid.weight": "mid.weight", "mid.bias": "mid.bias"},
    {"norm.weight": "norm.weight", "norm.bias": "norm.bias", "head": "emb.weight"},
]


def _stage_params(net, stage):
    held = {
        "emb": net.emb.weight, "mid.weight": net.mid.weight, "mid.bias": net.mid.bias,
        "norm.weight": net.norm.weight, "norm.bias": net.norm.bias, "head": net.head.weight,
    }  # fmt: skip
    return {held[key]: name for key, name in STAGE_NAMES[stage].items()}


def _stepped(make_optimizer=lambda params: torch.optim.AdamW(params, lr=0.1)):
    """A reference optimizer over the whole net and one per stage, each after the same one step."""
    torch.manual_seed(0)
    net = TiedNet()
    ref_net = copy.deepcopy(net)
    x = torch.tensor([[0, 1, 2], [3, 4, 0]])
    for model in (net, ref_net):
        model(x).square().mean().backward()
    ref = make_optimizer(ref_net.parameters())
    ref.step()
    stages = []
    for stage in range(2):
        names = _stage_params(net, stage)
        opt = make_optimizer(list(names))
        opt.step()  # the tied weight is stepped twice here; only the optimizer states are compared
        stages.append((opt, names))
    return ref, stages


def _assert_same_state(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=lambda m, key=key: f"{key}: {m}")


def test_named_state_is_keyed_by_parameter_name_and_keeps_the_hyper_parameters():
    _, [(opt, names), _] = _stepped()
    named = named_optimizer_state(opt, names)
    assert named["type"] == "AdamW"
    assert named["param_groups"][0]["params"] == ["emb.weight", "mid.weight", "mid.bias"]
    assert named["param_groups"][0]["lr"] == 0.1 and "param_names" not in named["param_groups"][0]
    assert set(named["state"]) == {"emb.weight", "mid.weight", "mid.bias"}
    _assert_same_state(named["state"]["mid.bias"], opt.state[opt.param_groups[0]["params"][2]])


def test_merged_stages_equal_the_single_device_state_and_load_into_a_plain_optimizer():
    ref, stages = _stepped()
    parts = [named_optimizer_state(opt, names) for opt, names in stages]
    merged = merge_optimizer_states(parts, ORDER)
    expected = ref.state_dict()
    assert merged["optimizer_type"] == "AdamW"
    [group] = merged["param_groups"]
    # The tied weight, held by both stages, appears once, at its place in the unsplit model.
    assert group["param_names"] == ORDER and group["params"] == [0, 1, 2, 3, 4]
    assert merged["state"].keys() == expected["state"].keys()
    for i in expected["state"]:
        _assert_same_state(merged["state"][i], expected["state"][i])

    plain = torch.optim.AdamW(TiedNet().parameters(), lr=0.5)
    plain.load_state_dict(merged)
    assert plain.param_groups[0]["lr"] == 0.1
    _assert_same_state(plain.state_dict()["state"][3], expected["state"][3])


def test_without_an_order_parameters_are_numbered_as_the_stages_list_them():
    _, stages = _stepped()
    parts = [named_optimizer_state(opt, names) for opt, names in reversed(stages)]
    unordered = merge_optimizer_states(parts)
    assert unordered["param_groups"][0]["param_names"] == [
        "norm.weight", "norm.bias", "emb.weight", "mid.weight", "mid.bias",
    ]  # fmt: skip
    assert merge_optimizer_states(parts, ORDER)["param_groups"][0]["param_names"] == ORDER


def test_stages_that_disagree_on_groups_or_type_cannot_be_merged():
    _, [(opt, names), _] = _stepped()
    part = named_optimizer_state(opt, names)
    two_groups = {
        **part,
        "param_groups": [part["param_groups"][0], {**part["param_groups"][0], "params": []}],
    }
    with pytest.raises(RuntimeError, match=r"disagree on the number of optimizer param groups: \[1, 2\]"):
        merge_optimizer_states([part, two_groups])
    with pytest.raises(RuntimeError, match=r"different optimizer types: \['AdamW', 'SGD'\]"):
        merge_optimizer_states([part, {**part, "type": "SGD"}])


@pytest.mark.parametrize("source", ["pipeline checkpoint", "single-device checkpoint"])
def test_reshard_gives_a_stage_its_slice_of_the_state(source):
    ref, stages = _stepped()
    if source == "pipeline checkpoint":
        full = merge_optimizer_states([named_optimizer_state(o, n) for o, n in stages], ORDER)
    else:  # Lightning on one device saves torch's layout: integer ids, no param_names
        full = ref.state_dict()
        assert "param_names" not in full["param_groups"][0]
    expected = ref.state_dict()["state"]
    for stage, positions in ((0, [0, 1, 2]), (1, [3, 4, 0])):
        names = _stage_params(TiedNet(), stage)
        fresh = torch.optim.AdamW(list(names), lr=0.5)
        local = reshard_optimizer_state(full, fresh, names, ORDER)
        assert local["param_groups"][0]["params"] == [0, 1, 2]
        fresh.load_state_dict(local)
        assert fresh.param_groups[0]["lr"] == 0.1
        for local_id, model_id in enumerate(positions):
            _assert_same_state(fresh.state_dict()["state"][local_id], expected[model_id])


def test_reshard_refuses_another_optimizer_type_or_grouping():
    ref, stages = _stepped()
    merged = merge_optimizer_states([named_optimizer_state(o, n) for o, n in stages], ORDER)
    names = _stage_params(TiedNet(), 0)
    params = list(names)
    with pytest.raises(
        ValueError, match="the checkpoint's optimizer is AdamW but configure_optimizers made SGD"
    ):
        reshard_optimizer_state(merged, torch.optim.SGD(params, lr=0.1), names, ORDER)
    two = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(ValueError, match="has 1 param groups but configure_optimizers made 2"):
        reshard_optimizer_state(merged, two, names, ORDER)
    # A single-device checkpoint names no type: the hyper-parameters tell the optimizers apart.
    with pytest.raises(
        ValueError, match=r"hyper-parameters \['amsgrad', .*'betas'.* but this one has .*'dampening'"
    ):
        reshard_optimizer_state(ref.state_dict(), torch.optim.SGD(params, lr=0.1), names, ORDER)


def test_reshard_refuses_a_parameter_missing_from_the_checkpoint_or_in_another_group():
    _, stages = _stepped()
    merged = merge_optimizer_states([named_optimizer_state(o, n) for o, n in stages], ORDER)
    extra = nn.Parameter(torch.zeros(2))
    names = {**_stage_params(TiedNet(), 0), extra: "extra.weight"}
    with pytest.raises(
        ValueError, match=r"parameter extra\.weight is not in the checkpoint's optimizer state"
    ):
        reshard_optimizer_state(merged, torch.optim.AdamW(list(names)), names, ORDER)

    # Saved with the embedding in a group of its own; resumed with it grouped with the rest.
    group = merged["param_groups"][0]
    split = {
        **merged,
        "param_groups": [
            {**group, "params": [0], "param_names": ORDER[:1]},
            {**group, "params": [1, 2, 3, 4], "param_names": ORDER[1:]},
        ],
    }
    names = _stage_params(TiedNet(), 0)
    params = list(names)
    regrouped = torch.optim.AdamW([{"params": params[1:]}, {"params": params[:1]}])
    with pytest.raises(ValueError, match=r"parameter mid\.weight is in another optimizer param group"):
        reshard_optimizer_state(split, regrouped, names, ORDER)


def test_an_unnamed_state_maps_onto_names_only_with_one_group_of_every_parameter():
    ref, _ = _stepped()
    names = _stage_params(TiedNet(), 0)
    opt = torch.optim.AdamW(list(names))
    unnamed = ref.state_dict()
    two_groups = {**unnamed, "param_groups": [{**unnamed["param_groups"][0], "params": [0]}] * 2}
    two_group_opt = torch.optim.AdamW([{"params": list(names)[:1]}, {"params": list(names)[1:]}])
    with pytest.raises(ValueError, match="several param groups without parameter names"):
        reshard_optimizer_state(two_groups, two_group_opt, names, ORDER)
    with pytest.raises(
        ValueError, match="holds 5 parameters but the model has 6: resume with the same model"
    ):
        reshard_optimizer_state(unnamed, opt, names, [*ORDER, "extra.weight"])


def test_check_keys_names_the_missing_and_unexpected_keys():
    check_keys(["a", "b"], {"b": 0, "a": 1}, "Net")
    with pytest.raises(KeyError, match=r"does not match Net: missing keys \['a'\], unexpected keys \['c'\]"):
        check_keys(["a", "b"], {"b": 0, "c": 1}, "Net")
    many = [f"k{i:02d}" for i in range(12)]
    with pytest.raises(KeyError, match=r"missing keys \['k00', .*'k09'\] \.\.\., unexpected keys \[\]"):
        check_keys(many, {}, "Net")


def test_to_cpu_detaches_every_tensor_and_keeps_the_containers():
    w = torch.ones(2, requires_grad=True) * 2
    out = to_cpu({"a": (w, [w, 3]), "b": "text"})
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1], list) and out["b"] == "text"
    assert not out["a"][0].requires_grad and out["a"][1][1] == 3
    torch.testing.assert_close(out["a"][0], torch.full((2,), 2.0))


def test_a_state_listed_in_another_order_is_refused_by_shape():
    from torch import nn

    from lightning_parallel.pipeline.state import reshard_optimizer_state

    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
    params = list(model.parameters())
    saved_opt = torch.optim.Adam(params[::-1])  # the single-device run listed them backwards
    for p in params:
        p.grad = torch.ones_like(p)
    saved_opt.step()
    full = saved_opt.state_dict()
    names = {p: n for n, p in model.named_parameters()}
    order = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"has shape \(4,\) but the parameter has \(3, 2\)"):
        reshard_optimizer_state(full, torch.optim.Adam(params), names, order)
