"""Micro-batches in flight per stage, read from torch's own schedule orders (no processes)."""

import pytest

from lightning_parallel.planner.schedule import peak_in_flight, rank_actions


def _order(actions):
    return [f"{a.kind}{a.stage}.{a.microbatch}" for a in actions]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4)])
def test_gpipe_keeps_every_microbatch_in_flight(p, m):
    assert [peak_in_flight(a) for a in rank_actions("gpipe", p, 1, m)] == [{s: m} for s in range(p)]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 5)])
def test_1f1b_keeps_p_minus_s_on_stage_s(p, m):
    assert [peak_in_flight(a) for a in rank_actions("1f1b", p, 1, m)] == [{s: p - s} for s in range(p)]


def test_1f1b_with_fewer_microbatches_than_stages_runs_as_gpipe_like_the_runner():
    assert [peak_in_flight(a) for a in rank_actions("1f1b", 4, 1, 2)] == [{s: 2} for s in range(4)]


def test_interleaved_order_is_torchs():
    # torch 2.13's ScheduleInterleaved1F1B order for 2 ranks x 2 stages each, 4 micro-batches.
    # If torch changes its schedule, this fails and the planner's in-flight counts need a look.
    rank0, rank1 = rank_actions("interleaved_1f1b", 2, 2, 4)
    assert _order(rank0) == [
        "F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "B2.0", "F0.3", "B2.1", "F2.2", "B0.0", "F2.3", "B0.1",
        "B2.2", "B2.3", "B0.2", "B0.3",
    ]  # fmt: skip
    assert peak_in_flight(rank0) == {0: 4, 2: 2}
    assert peak_in_flight(rank1) == {1: 3, 3: 1}


def test_looped_bfs_and_zero_bubble_orders():
    assert [peak_in_flight(a) for a in rank_actions("looped_bfs", 2, 2, 4)] == [{0: 4, 2: 4}, {1: 4, 3: 4}]
    zb = rank_actions("interleaved_zero_bubble", 2, 2, 4)
    assert {a.kind for a in zb[0]} == {"F", "I", "W"}  # input and weight gradients apart
    assert [peak_in_flight(a) for a in zb] == [{0: 4, 2: 2}, {1: 4, 3: 2}]


def test_every_stage_runs_m_forwards_and_m_backwards():
    # Counts, not micro-batch ids: torch 2.13's 1F1B order numbers the last rank's forwards 1..m
    # (its schedule IR; the runtime runs 0..m-1). The planner only counts, so it is unaffected.
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2)]:
        for rank, actions in enumerate(rank_actions(schedule, 4, v, 8)):
            for stage in (rank + 4 * i for i in range(v)):
                for kind in ("F", "B"):
                    done = [a for a in actions if a.kind == kind and a.stage == stage]
                    assert len(done) == 8, (schedule, rank, stage, kind)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        rank_actions("zigzag", 2, 1, 4)
