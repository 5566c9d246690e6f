"""distributed/agree.py: one rank's error becomes every rank's error, or every rank goes on."""

import os

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo

from lightning_parallel.distributed.agree import agree, decide_on, failing_together


class NeedsTwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_single_process_raises_its_own_error_or_returns():
    agree(None)
    with pytest.raises(ValueError, match="mine"):
        agree(ValueError("mine"))
    assert decide_on(0, lambda: 41 + 1) == 42
    with pytest.raises(KeyError, match="missing"), failing_together():
        raise KeyError("missing")


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as err:
        return (type(err).__name__, str(err), list(getattr(err, "__notes__", [])))


def _worker(rank: int, world: int, out_dir: str) -> None:
    results = {
        "none_failed": _outcome(lambda: agree(None)),
        "rank1_failed": _outcome(lambda: agree(ValueError("bad batch on rank 1") if rank == 1 else None)),
        "both_failed": _outcome(lambda: agree(KeyError(f"rank {rank}"))),
        "unpicklable": _outcome(lambda: agree(NeedsTwoArgs("x", "y") if rank == 0 else None)),
        "decided": _outcome(lambda: decide_on(1, lambda: [rank, "from rank 1"])),
        "decision_failed": _outcome(lambda: decide_on(0, lambda: 1 / 0)),
    }

    def block():
        with failing_together():
            if rank == 0:
                raise TypeError("loader of rank 0")
        dist.barrier()  # reached by no rank: the block raised everywhere

    results["together"] = _outcome(block)
    # After all of that the group still works: no rank was left inside a collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    results["still_in_step"] = float(t)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_gloo_ranks_raise_the_same_error_or_go_on_together(tmp_path):
    r0, r1 = spawn_gloo(_worker, 2, tmp_path)
    for r in (r0, r1):
        assert r["none_failed"] == ("ok", None)
        assert r["rank1_failed"][:2] == ("ValueError", "bad batch on rank 1")
        assert r["both_failed"][0] == "KeyError"
        assert r["decided"] == ("ok", [1, "from rank 1"])
        assert r["decision_failed"][:2] == ("ZeroDivisionError", "division by zero")
        assert r["together"][:2] == ("TypeError", "loader of rank 0")
        assert r["still_in_step"] == 2.0
    # The rank that failed raises its own error; the other one says where the error came from.
    assert r0["rank1_failed"][2] == ["raised on global rank 1; this rank stops with it"]
    assert r1["rank1_failed"][2] == []
    assert r0["both_failed"][1] == "'rank 0'" and r1["both_failed"][1] == "'rank 1'"
    # An exception that cannot be rebuilt from its pickle travels as text.
    assert r0["unpicklable"][:2] == ("NeedsTwoArgs", "x and y")
    assert r1["unpicklable"][:2] == ("RuntimeError", "NeedsTwoArgs: x and y")
