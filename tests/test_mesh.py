"""layout/ranks.py and layout/mesh.py: the pipeline-outermost rank layout and its roles (pure logic; the
groups are built in multi-process tests: tests/test_shared.py)."""

from dataclasses import dataclass

import pytest

from lightning_parallel.layout.mesh import build_mesh
from lightning_parallel.layout.ranks import DATA_PARALLEL_ROLES, MESH_DIMS, ROLES, Axis, RankLayout


def test_layout_puts_the_replicas_of_a_pipeline_rank_next_to_each_other():
    layout = RankLayout(pp_size=2, dp_size=3)
    assert [layout.global_rank(p, d) for p in range(2) for d in range(3)] == list(range(6))
    assert layout.coordinates(4) == (1, 1) and layout.replicas_of(1) == (3, 4, 5)
    assert all(layout.global_rank(*layout.coordinates(r)) == r for r in range(6))
    assert RankLayout.for_world(8, 4) == RankLayout(4, 2)


def test_a_pipeline_size_that_does_not_divide_the_world_is_refused_with_choices():
    with pytest.raises(
        ValueError, match=r"pipeline_size \(4\) does not divide devices x nodes \(6\).*4 or 8"
    ):
        RankLayout.for_world(6, 4)
    # Fewer devices than one pipeline: two distinct examples (they read "3 or 3" for 2 devices).
    with pytest.raises(ValueError, match=r"use a multiple of 3 devices \(e\.g\. 3 or 6\)"):
        RankLayout.for_world(2, 3)


def test_one_rank_needs_no_process_group():
    mesh = build_mesh("cpu", RankLayout(1, 1))
    assert mesh.pp_group is None and mesh.is_last_pipeline_rank and mesh.global_rank(0) == 0
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        build_mesh("cpu", RankLayout(2, 1))


def test_the_data_parallel_ranks_split_into_replicas_of_shards_on_the_mesh():
    layout = RankLayout(pp_size=2, dp_size=4, dp_shard_size=2)
    assert layout.mesh_shape == (2, 2, 2, 1) and layout.dp_replicate_size == 2
    assert layout.coordinates(5) == (1, 1) and RankLayout(2, 4) == RankLayout(2, 4, 1)
    with pytest.raises(
        ValueError, match=r"data_parallel_shard_size \(3\) does not divide the 4 .*divisor of 4"
    ):
        RankLayout(pp_size=2, dp_size=4, dp_shard_size=3)


def test_tensor_parallel_ranks_are_innermost_and_share_the_data_parallel_rank():
    layout = RankLayout(pp_size=2, dp_size=2, dp_shard_size=2, tp_size=2)
    assert layout.world_size == 8 and layout.mesh_shape == (2, 1, 2, 2)
    assert [layout.global_rank(1, 1, t) for t in range(2)] == [6, 7]  # tp peers are neighbours
    assert layout.coordinates(6) == layout.coordinates(7) == (1, 1) and layout.tp_rank_of(7) == 1
    assert layout.replicas_of(0) == (0, 1, 2, 3)
    assert RankLayout.for_world(8, 2, tp_size=2) == RankLayout(2, 2, 1, 2)
    with pytest.raises(
        ValueError, match=r"pipeline_size x tensor_parallel_size \(2 x 2 = 4\) does not divide"
    ):
        RankLayout.for_world(6, 2, tp_size=2)


# A hypothetical sequence-parallel axis between the data- and tensor-parallel ones (issue 53): one entry in
# the axes, the roles it joins (not "data": its ranks read one batch, each a slice of its sequence).
SEQUENCE_ROLES = frozenset(("gradients", "shard", "optimizer_shard", "tokens", "metrics", "logs", "step"))


@dataclass(frozen=True)
class WithSequenceAxis(RankLayout):
    sp_size: int = 2

    @property
    def axes(self):
        pp, replicate, shard, tp = super().axes
        return (pp, replicate, shard, Axis("sp", self.sp_size, SEQUENCE_ROLES), tp)


def test_every_role_of_todays_layout_is_the_data_parallel_ranks_but_the_pipeline_tensor_and_shard():
    layout = RankLayout(pp_size=2, dp_size=4, dp_shard_size=2, tp_size=2)  # 16 ranks
    assert [a.name for a in layout.axes] == list(MESH_DIMS) and set(ROLES) >= {"gradients", "data", "tokens"}
    for rank in range(16):
        pp_rank, dp_rank = layout.coordinates(rank)
        assert layout.rank("pipeline", rank) == pp_rank
        assert layout.rank("tensor", rank) == layout.tp_rank_of(rank)
        assert layout.rank("shard", rank) == dp_rank % 2
        for role in DATA_PARALLEL_ROLES:
            assert layout.rank(role, rank) == dp_rank and layout.size(role) == 4
            assert layout.group_of(role, rank) == [layout.global_rank(pp_rank, d, rank % 2) for d in range(4)]
    assert layout.size("pipeline") == layout.size("tensor") == layout.size("shard") == 2
    # Every rank is in exactly one group of each role, and the groups are listed alike on every rank.
    for role in ROLES:
        assert sorted(r for group in layout.groups(role) for r in group) == list(range(16))
    assert layout.groups("pipeline")[:2] == [[0, 8], [1, 9]] and layout.groups("shard")[0] == [0, 2]
    with pytest.raises(ValueError, match=r"unknown role 'replicas': choose one of pipeline, tensor"):
        layout.size("replicas")


def test_a_new_axis_joins_the_roles_it_names_and_leaves_the_others_alone():
    # pp=2 x (replicate 2 x shard 1) x sp=2 x tp=1: global rank = (pp x 2 + replica) x 2 + sp.
    layout = WithSequenceAxis(pp_size=2, dp_size=2)
    assert layout.world_size == 8 and layout.mesh_shape == (2, 2, 1, 2, 1)
    assert layout.groups("gradients") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # replicas x sequence slices
    assert layout.groups("data") == layout.groups("predictions") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("shard") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.size("tokens") == 4 and layout.size("data") == 2 and layout.rank("data", 6) == 1
    assert layout.rank("gradients", 6) == 2 and layout.rank("pipeline", 6) == 1
