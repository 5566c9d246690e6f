"""distributed/record_broadcast.py: the layout travels when it changes, the numbers in one broadcast."""

import os

import pytest
import torch
from mp_harness import spawn_gloo

from lightning_parallel.distributed.record_broadcast import RecordBroadcast


def test_one_process_returns_the_record():
    assert RecordBroadcast(src=0).broadcast((("a",), [1.5])) == (("a",), [1.5])


def _worker(rank: int, world: int, out_dir: str) -> None:
    channel = RecordBroadcast(src=1)
    records = [
        (("loss",), [0.5]),
        (("loss",), [0.25]),
        (("loss", "acc"), [0.1, 0.9]),
        (("loss", "acc"), [0.2, 0.8]),
    ]
    records.append((("many",), [float(i) for i in range(40)]))  # more values than the agreed capacity
    got = [channel.broadcast(record if rank == 1 else None) for record in records]
    objects = channel.object_broadcasts
    raised = None
    try:  # an error on the source travels in the record's place: every rank raises it
        channel.broadcast(None, error=ValueError("step failed") if rank == 1 else None)
    except ValueError as err:
        raised = (str(err), getattr(err, "__notes__", []))
    after = channel.broadcast((("loss",), [0.75]) if rank == 1 else None)  # and the channel goes on
    record = {"got": got, "objects": objects, "raised": raised, "after": after}
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_numbers_arrive_exactly_and_the_layout_travels_only_when_it_changes(tmp_path):
    r0, r1 = spawn_gloo(_worker, 2, tmp_path)
    assert r0["got"] == r1["got"]
    assert r0["got"][:4] == [
        (("loss",), [0.5]),
        (("loss",), [0.25]),
        (("loss", "acc"), [0.1, 0.9]),
        (("loss", "acc"), [0.2, 0.8]),
    ]
    assert r0["got"][4] == (("many",), [float(i) for i in range(40)])
    assert r0["objects"] == r1["objects"] == 3  # first record, new layout, too many values
    assert r1["raised"] == ("step failed", [])
    assert r0["raised"] == ("step failed", ["raised on global rank 1; this rank stops with it"])
    assert r0["after"] == r1["after"] == (("loss",), [0.75])


def _posting_worker(rank: int, world: int, out_dir: str) -> None:
    """The receivers post ahead, the sender sends late: the numbers arrive all the same, in order."""
    import time

    channel = RecordBroadcast(src=0)
    got = []
    for step in range(4):
        if rank != 0:
            channel.post()
            channel.post()  # a second post before the broadcast is a no-op
        else:
            time.sleep(0.05)  # the schedule's drain: the receivers are already waiting
        record = (("loss", "acc"), [step / 2, 1 - step / 4]) if step != 2 else (("loss",), [9.0])
        got.append(channel.broadcast(record if rank == 0 else None))
    if rank != 0:
        channel.post()  # and an error on the sender arrives through a posted receive too
    raised = None
    try:
        channel.broadcast(None, error=ValueError("late failure") if rank == 0 else None)
    except ValueError as err:
        raised = str(err)
    record = {"got": got, "objects": channel.object_broadcasts, "raised": raised}
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_receive_posted_ahead_gets_the_numbers_and_the_new_layouts(tmp_path):
    ranks = spawn_gloo(_posting_worker, 3, tmp_path)
    expected = [(("loss", "acc"), [0.0, 1.0]), (("loss", "acc"), [0.5, 0.75]), (("loss",), [9.0])]
    expected.append((("loss", "acc"), [1.5, 0.25]))
    assert all(r["got"] == expected for r in ranks)
    assert all(r["objects"] == 3 for r in ranks)  # first record, and each change of layout
    assert all(r["raised"] == "late failure" for r in ranks)
