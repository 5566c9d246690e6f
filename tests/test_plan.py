"""plan.py: the stage plan and its table (pure logic).

Covers _table.py (format_table: columns padded to the widest cell, the rule under the headers) through the
plan's table.
"""

from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.pipeline.plan import describe_layers, describe_paths, make_plan, shard_bytes


def test_stage_table_names_stages_ranks_contents_and_parameters():
    holds = [
        describe_layers(["0"], ["Embedding"]),
        describe_layers(["1", "2", "3"], ["Block", "Block", "Linear"]),
    ]
    plan = make_plan([("0",), ("1", "2", "3")], holds, [5, 16], RankLayout(pp_size=2, dp_size=2))
    table = plan.format_table()
    assert "0      0,1    0  (Embedding)" in table
    assert "1      2,3    1-3  (Blockx2, Linear)  16" in table
    assert "2 stages on 2 pipeline ranks x 2 data-parallel replicas; 21 parameters" in table


def test_interleaved_stages_loop_over_pipeline_ranks():
    plan = make_plan([(str(i),) for i in range(4)], ["x"] * 4, [1] * 4, RankLayout(pp_size=2, dp_size=1))
    assert [s.index for s in plan.local_stages(0)] == [0, 2]
    assert [s.index for s in plan.local_stages(1)] == [1, 3]
    assert plan.stages_per_rank == 2 and plan.pp_rank_of(3) == 1
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)]


def test_a_tied_weight_counts_once_in_the_total_and_is_noted():
    params = [frozenset({"wte.weight", "h.0.w"}), frozenset({"h.1.w", "wte.weight"})]
    plan = make_plan(
        [("wte", "h.0"), ("h.1", "lm_head")], ["wte, h.0", "h.1, lm_head"], [130, 110],
        RankLayout(pp_size=2, dp_size=1), stage_parameters=params, shared_sizes={"wte.weight": 100},
        notes=["wte.weight is used by stages 0, 1"],
    )  # fmt: skip
    assert plan.total_parameters() == 140
    assert plan.format_table().splitlines()[-1] == "wte.weight is used by stages 0, 1"


def test_module_paths_are_described_with_runs_of_blocks_collapsed():
    assert describe_paths(["wte", "wpe", "h.0", "h.1"]) == "wte, wpe, h.0-1"
    assert describe_paths(["h.2", "h.3", "ln_f", "lm_head"]) == "h.2-3, ln_f, lm_head"
    assert describe_paths(["transformer.h.4", "transformer.h.6"]) == "transformer.h.4, transformer.h.6"
    assert describe_paths(["a.1", "b.2", "b.3", "b.4"]) == "a.1, b.2-4"


def test_a_sharded_layout_shows_each_ranks_share_of_a_stage():
    assert (
        shard_bytes((13, 8), 4, 4) == 4 * 8 * 4
        and shard_bytes((8,), 2, 4) == 2 * 2
        and shard_bytes((), 4, 4) == 4
    )
    fsdp = make_plan([("0",), ("1",)], ["a", "b"], [104, 64], RankLayout(2, 4, 4), bytes_per_rank=[128, 64])
    table = fsdp.format_table()
    assert "per rank (1/4 shard)" in table and "0,1,2,3  a      104         128 B" in table
    assert "2 pipeline ranks x 4 data-parallel ranks, each stage sharded over 4 of them (FSDP2);" in table
    hsdp = make_plan([("0",), ("1",)], ["a", "b"], [104, 64], RankLayout(2, 4, 2), bytes_per_rank=[208, 128])
    assert "sharded over 2 of them (FSDP2), the shards replicated 2 times (HSDP)" in hsdp.format_table()
    assert "per rank" not in make_plan([("0",)], ["a"], [1], RankLayout(1, 2)).format_table()
