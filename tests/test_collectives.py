"""ScalarReducer, reduce maps and the unpadded evaluation sampler: pure logic, then 2 gloo processes."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mp_harness import START_METHOD, free_port

from lightning_parallel.data.eval_sampler import EvalDistributedSampler, eval_shard
from lightning_parallel.distributed.collectives import (
    ScalarReducer,
    agree_keys,
    match_reduce_op,
    min_over_ranks,
    validate_reduce_map,
)


def test_reduce_map_validation_and_glob_matching():
    reduce = validate_reduce_map({"tokens": "SUM", "*_max": "max", "loss_max": "min"})
    assert match_reduce_op("tokens", reduce, "mean") == "sum"
    assert match_reduce_op("grad_max", reduce, "mean") == "max"
    assert match_reduce_op("loss_max", reduce, "mean") == "min"  # an exact name wins over a glob
    assert match_reduce_op("loss", reduce, "mean") == "mean"
    with pytest.raises(
        ValueError, match=r"unknown reduction 'median' for 'x': use one of mean, sum, max, min"
    ):
        validate_reduce_map({"x": "median"})
    with pytest.raises(TypeError, match="dict of metric name"):
        validate_reduce_map(["x"])


def test_single_process_reducer_is_the_identity_and_checks_values():
    reducer = ScalarReducer()
    out = reducer.reduce({"a": (2.0, 3, "mean"), "b": (5.0, 1, "sum"), "empty": (float("nan"), 0, "mean")})
    assert out["a"].value == 2.0 and out["b"].value == 5.0 and out["a"].ranks == (0,)
    assert "empty" not in out  # weight 0 (an empty batch) counts as not logged
    with pytest.raises(ValueError, match=r"'a' is not finite \(rank 0: inf\)"):
        reducer.reduce({"a": (float("inf"), 1, "mean")})
    assert ScalarReducer(allow_nonfinite=True).reduce({"a": (float("inf"), 1, "sum")})["a"].value == float(
        "inf"
    )
    with pytest.raises(ValueError, match="unknown reduction"):
        ScalarReducer().reduce({"a": (1.0, 1, "median")})


def test_eval_shards_partition_the_data_set_without_padding():
    for n, w in [(1001, 2), (7, 3), (2, 4), (0, 2)]:
        shards = [list(EvalDistributedSampler(range(n), num_replicas=w, rank=r)) for r in range(w)]
        assert sorted(i for s in shards for i in s) == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= (1 if n else 0)
        assert [len(EvalDistributedSampler(range(n), w, r)) for r in range(w)] == list(map(len, shards))
    with pytest.raises(ValueError, match=r"rank \(2\) must be in \[0, num_replicas \(2\)\)"):
        eval_shard(10, 2, 2)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        reducer = ScalarReducer()
        # Uneven weights; a key only rank 1 has; a rank with an empty batch (weight 0).
        entries = {
            "loss": (1.0 + rank, 1 + 2 * rank, "mean"),
            "n": (10.0 * rank, 1, "sum"),
            "hi": (float(rank), 1, "max"),
            "lo": (float(rank), 1, "min"),
            "empty_on_0": (3.0, 0 if rank == 0 else 2, "mean"),
        }
        if rank == 1:
            entries["only1"] = (7.0, 1, "mean")
        first = reducer.reduce(entries)
        calls = reducer.collectives
        steady = reducer.reduce({k: v for k, v in entries.items() if k != "only1"})
        results["first"] = {k: (r.value, r.ranks) for k, r in first.items()}
        results["steady"] = {k: (r.value, r.ranks) for k, r in steady.items()}
        results["calls"] = (calls, reducer.collectives - calls)
        results["keys"] = agree_keys([f"k{rank}"])
        results["min"] = min_over_ranks([float(5 + rank), float("inf")])
        for bad in (
            {"x": (1.0, 1, "mean" if rank == 0 else "max")},
            {"x": (float("nan") if rank else 1.0, 1, "mean")},
        ):
            try:
                reducer.reduce(bad)
                results.setdefault("errors", []).append(None)
            except ValueError as e:
                results.setdefault("errors", []).append(str(e))
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_gloo_ranks_reduce_in_one_collective_and_fail_alike(tmp_path):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method=START_METHOD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    first = r0["first"]
    assert first["loss"] == (pytest.approx((1 * 1 + 2 * 3) / 4), (0, 1))
    assert first["n"][0] == 10.0 and first["hi"][0] == 1.0 and first["lo"][0] == 0.0
    assert first["empty_on_0"] == (3.0, (1,))
    assert first["only1"] == (7.0, (1,))  # reaches rank 0 although rank 0 never logged it
    assert r0["steady"]["loss"][0] == pytest.approx(7 / 4) and "only1" not in r0["steady"]
    assert r0["calls"] == (3, 1)  # gather + agree + gather, then 1 per call
    assert r0["keys"] == r1["keys"] == ["k0", "k1"]
    assert r0["min"] == [5.0, float("inf")]
    for r in (r0, r1):  # every rank raises, with the same message
        assert r["first"] == first
        assert r["errors"][0] == r0["errors"][0] and "'x' is reduced differently" in r["errors"][0]
        assert "rank 0: mean, rank 1: max" in r["errors"][0]
        assert r["errors"][1] == r0["errors"][1] and "'x' is not finite (rank 1: nan)" in r["errors"][1]
