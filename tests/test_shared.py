"""grads/tied.py: tied weights named once, re-tied, found across ranks, and kept identical (gloo); the
same job builds layout/mesh.py's groups by role, with a sequence-parallel axis."""

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo
from torch import nn

from lightning_parallel.grads.tied import SharedParameter, SharedReplicas, find_shared
from lightning_parallel.layout.mesh import build_mesh
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.sources.twin import alias_table, retie


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("mask", torch.ones(3))
        self.blocks[1].register_buffer("mask", self.mask)  # a buffer reached by two names as well


def test_alias_table_maps_every_name_to_the_one_named_parameters_reports():
    model = Tied()
    table = alias_table(model)
    assert table["head.weight"] == "wte.weight" and table["wte.weight"] == "wte.weight"
    assert table["blocks.1.mask"] == "mask" and table["blocks.0.bias"] == "blocks.0.bias"
    assert set(table) == {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
        n for n, _ in model.named_buffers(remove_duplicate=False)
    }
    assert set(table.values()) == {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}


def test_retie_undoes_what_to_empty_unties():
    with torch.device("meta"):
        model = Tied()
    aliases = alias_table(model)
    model.to_empty(device="cpu")
    assert model.head.weight is not model.wte.weight  # to_empty gives each name its own tensor
    retie(model, aliases)
    assert model.head.weight is model.wte.weight

    del model.wte  # a rank that kept only the head: nothing to tie it to, nothing changes
    head = model.head.weight
    retie(model, aliases)
    assert model.head.weight is head


def test_find_shared_lists_only_weights_used_on_several_pipeline_ranks():
    stages = [{"wte.weight", "h.0"}, {"h.1"}, {"h.2", "wte.weight"}, {"h.3", "wte.weight", "ln.weight"}]
    # pp_size=2: stages 0 and 2 share rank 0 (one tensor, no collective); stage 3 is on rank 1.
    assert find_shared(stages, pp_size=2) == [SharedParameter("wte.weight", (0, 2, 3), (0, 1))]
    assert find_shared(stages, pp_size=4) == [SharedParameter("wte.weight", (0, 2, 3), (0, 2, 3))]
    assert find_shared(stages[:3], pp_size=2) == []
    # The lowest pipeline rank that holds it is listed first: it owns the weight.
    late = [{"x"}, {"h.1", "w"}, {"w"}, {"y"}]
    assert find_shared(late, pp_size=2) == [SharedParameter("w", (1, 2), (0, 1))]
    assert [p.name for p in find_shared([{"b", "a"}, {"a", "b"}], 2)] == ["a", "b"]


def _replicas(layout, stage_params, rank):
    """Build the mesh, this rank's replicas (values: its rank) and the SharedReplicas over them."""
    mesh = build_mesh("cpu", layout)
    shared = find_shared(stage_params, layout.pp_size)
    held = sorted(set().union(*stage_params[mesh.pp_rank :: layout.pp_size]))
    local = {n: nn.Parameter(torch.full((2,), float(rank))) for n in held}
    return mesh, local, SharedReplicas(shared, mesh, local)


def _worker(rank: int, world: int, out_dir: str) -> None:
    out = {}
    # Four pipeline ranks: `a` and `c` tie stages 0 and 3, `b` is used by stages 1, 2 and 3.
    stages = [{"a", "c", "x0"}, {"b", "x1"}, {"b", "x2"}, {"a", "b", "c", "x3"}]
    mesh, local, replicas = _replicas(RankLayout(pp_size=4, dp_size=1), stages, rank)
    replicas.broadcast_from_owners()
    out["pp4_values"] = {n: p.detach().clone() for n, p in local.items()}
    for name, p in local.items():
        if not (rank == 2 and name == "b"):  # rank 2's stage did not reach `b` in this step
            p.grad = torch.full((2,), 10.0**mesh.pp_rank)
    replicas.sum_gradients()
    out["pp4_grads"] = {n: p.grad.clone() for n, p in local.items()}
    out["pp4_not_counted"] = sorted(n for n, p in local.items() if any(p is q for q in replicas.not_counted))

    # Two pipeline ranks x two replicas: `w` ties stage 0 and 1; each replica sums over its own pair.
    mesh, local, replicas = _replicas(RankLayout(pp_size=2, dp_size=2), [{"w", "u"}, {"w", "v"}], rank)
    replicas.broadcast_from_owners()
    out["pp2dp2_values"] = {n: p.detach().clone() for n, p in local.items()}
    for p in local.values():
        p.grad = torch.full((2,), float(rank + 1))
    replicas.sum_gradients()
    out["pp2dp2_grads"] = {n: p.grad.clone() for n, p in local.items()}
    out["roles"] = _roles_with_a_sequence_axis()
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def _roles_with_a_sequence_axis():
    """2 replicas x 2 sequence slices: each role's group (its ranks, as torch has them), and a sum over it."""
    mesh = build_mesh("cpu", RankLayout(pp_size=1, dp_size=2, sp_size=2))
    roles = {}
    for role in ("gradients", "shard", "data", "tokens", "predictions", "pipeline"):
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=mesh.group(role))
        roles[role] = (dist.get_process_group_ranks(mesh.group(role)), mesh.rank(role), total.item())
    sharding = mesh.data_parallel_mesh()
    roles["fsdp mesh"] = (sharding.mesh_dim_names, tuple(sharding.shape))
    return roles


def full(value):
    return torch.full((2,), float(value))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_replicas_start_from_the_owner_and_sum_gradients_over_exactly_their_holders(tmp_path):
    r = spawn_gloo(_worker, 4, tmp_path)
    # pipeline_size=4: `a`, `c` are owned by rank 0 (held by 0, 3), `b` by rank 1 (held by 1, 2, 3).
    for rank, expected in enumerate(
        [{"a": 0, "c": 0, "x0": 0}, {"b": 1, "x1": 1}, {"b": 1, "x2": 2}, {"a": 0, "b": 1, "c": 0, "x3": 3}]
    ):
        for name, value in expected.items():
            torch.testing.assert_close(r[rank]["pp4_values"][name], full(value))
    sums = {"a": 1 + 1000, "c": 1 + 1000, "b": 10 + 0 + 1000}  # rank 2 adds zero for `b`
    locals_ = {0: 1, 1: 10, 2: 100, 3: 1000}
    for rank in range(4):
        for name, grad in r[rank]["pp4_grads"].items():
            torch.testing.assert_close(grad, full(sums.get(name, locals_[rank])), msg=f"rank {rank} {name}")
    assert [r[k]["pp4_not_counted"] for k in range(4)] == [[], [], ["b"], ["a", "b", "c"]]

    # 2 x 2 (global rank = pp_rank x 2 + replica): `w` of replica 0 on ranks 0, 2; of replica 1 on 1, 3.
    owner = {0: 0, 1: 1, 2: 0, 3: 1}
    pair_sum = {0: 1 + 3, 2: 1 + 3, 1: 2 + 4, 3: 2 + 4}
    for rank in range(4):
        torch.testing.assert_close(r[rank]["pp2dp2_values"]["w"], full(owner[rank]))
        torch.testing.assert_close(r[rank]["pp2dp2_grads"]["w"], full(pair_sum[rank]))
        other = "u" if rank < 2 else "v"
        torch.testing.assert_close(r[rank]["pp2dp2_values"][other], full(rank))  # not shared: untouched
        torch.testing.assert_close(r[rank]["pp2dp2_grads"][other], full(rank + 1))

    # A sequence axis (global rank = replica x 2 + slice) joins the gradients' and the shard's groups,
    # not the data's: the samplers' replicas are still 2, each group sums exactly its ranks.
    for rank in range(4):
        replica, piece = divmod(rank, 2)
        data = [piece, piece + 2]
        assert r[rank]["roles"] == {
            "gradients": ([0, 1, 2, 3], rank, 6.0),
            "shard": ([2 * replica, 2 * replica + 1], piece, float(4 * replica + 1)),
            "data": (data, replica, float(sum(data))),
            "tokens": ([0, 1, 2, 3], rank, 6.0),
            "predictions": (data, replica, float(sum(data))),
            "pipeline": ([rank], 0, float(rank)),
            "fsdp mesh": (("dp_replicate", "dp_shard_sp"), (2, 2)),
        }
