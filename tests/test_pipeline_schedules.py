"""Zero-bubble and V-shaped schedules against one device (both split paths), the V placement, the timeline,
and the multi-stage schedules with every stage on one rank (pipeline_size=1), validation between epochs.

The multi-process configurations share one spawned job of 2 gloo ranks: each rank runs several Trainers
in turn on the process group the job set up (as under torchrun), so the imports are paid once.

Covers callbacks/timeline.py (PipelineTimeline recording chosen steps on every rank).
"""

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_harness import RankRecorder, assert_close_dicts, fit, quiet_trainer, reference_loader, spawn_gloo
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data

from lightning_parallel import PipelineStrategy, PipelineTimeline
from lightning_parallel.callbacks import timeline as timeline_callback
from lightning_parallel.distributed.clock import clock_offsets
from lightning_parallel.pipeline.plan import stage_rank
from lightning_parallel.timeline.recorder import Timeline
from lightning_parallel.timeline.report import by_step, summarize

# 58 samples, global batch 16: the epoch ends on a batch of 10, which num_microbatches=4 does not divide
# (2 micro-batches: fewer than DualPipeV's 4 stages, so that batch runs ZBV on the same placement).
N_SAMPLES, GLOBAL_BATCH, WORLD = 58, 16, 2
TRAIN = dict(max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2)
TRACED_V = ("zbv", "dualpipev")
GPT_DATA = token_data(44)  # the last batch of 4 runs 4 micro-batches of 1
CONFIGS = {
    "1f1b": dict(schedule="1f1b"),
    "zbv": dict(schedule="zbv"),
    "dualpipev": dict(schedule="dualpipev"),
    "interleaved_zero_bubble": dict(schedule="interleaved_zero_bubble", stages_per_rank=2),
}
# pipeline_size=1: two replicas, each rank holding both stages (a stage and the next on one rank). Each
# epoch's validation (forward-only) runs between training batches: training after it must go on as on
# one device (torch 2.13's own forward-only step fails there; the V placement's fix covers it).
ONE_RANK = {
    f"one-rank-{s}": dict(pipeline_size=1, stages_per_rank=2, schedule=s)
    for s in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
}


@contextmanager
def _writes_timed() -> Iterator[list[tuple[int, int]]]:
    """When PipelineTimeline writes its files: (start, end) of each write, on the timeline's clock."""
    writes: list[tuple[int, int]] = []
    originals = {name: getattr(timeline_callback, name) for name in ("write_gantt", "write_trace")}

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        def write(*args: Any, **kwargs: Any) -> Any:
            start = Timeline.now()
            try:
                return original(*args, **kwargs)
            finally:
                writes.append((start, Timeline.now()))

        return write

    try:
        for name, original in originals.items():
            setattr(timeline_callback, name, timed(original))
        yield writes
    finally:
        for name, original in originals.items():
            setattr(timeline_callback, name, original)


def _job(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    data = regression_data(N_SAMPLES)
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        strategy = PipelineStrategy(pipeline_size=2, num_microbatches=4, **cfg)
        # Recorded batches 6 and 7, one after the other (4 batches an epoch: 7 is the second epoch's
        # last, the short one; 8 is recorded too, but never runs: the records are reported when
        # training ends): the numbers must not change, the timeline is checked below.
        timeline = PipelineTimeline(steps=[6, 7, 8], dirpath=Path(out_dir) / name / "timeline")
        callbacks = [RankRecorder(Path(out_dir) / name), timeline]
        trainer = quiet_trainer(devices=world, strategy=strategy, callbacks=callbacks, **TRAIN)
        # Validation runs forward-only: under a V placement, VForwardOnly (torch's V schedules cannot).
        with _writes_timed() as writes:
            trainer.fit(SequentialRegressor(), loader(data, GLOBAL_BATCH), loader(regression_data(16), 8))
        if rank == 0:
            torch.save(strategy.plan, Path(out_dir) / f"{name}-plan.pt")
            torch.save((timeline.records, writes), Path(out_dir) / f"{name}-timeline.pt")
    for name, cfg in ONE_RANK.items():
        torch.manual_seed(0)
        strategy = PipelineStrategy(num_microbatches=4, **cfg)
        # (two replicas: the overlapped all-reduce's span on each rank's row, where backward is not split)
        timeline = PipelineTimeline(steps=[1], dirpath=Path(out_dir) / name / "timeline")
        callbacks = [RankRecorder(Path(out_dir) / name), timeline]
        trainer = quiet_trainer(devices=world, strategy=strategy, callbacks=callbacks, **TRAIN)
        # Each replica half of the global batch (and of the validation set) under Lightning's sampler.
        trainer.fit(
            SequentialRegressor(),
            loader(data, GLOBAL_BATCH // world),
            loader(regression_data(16), 8 // world),
        )
        if rank == 0:
            torch.save(timeline.records, Path(out_dir) / f"{name}-timeline.pt")
    # The traced path (a GPT whose head is tied to its embedding: both on rank 0 under V) runs the V
    # schedules too: its stages are manual PipelineStages.
    for name in TRACED_V:
        torch.manual_seed(0)
        strategy = PipelineStrategy(pipeline_size=2, num_microbatches=4, schedule=name)
        trainer = quiet_trainer(
            devices=world,
            strategy=strategy,
            callbacks=[RankRecorder(Path(out_dir) / f"traced-{name}")],
            **TRAIN,
        )
        trainer.fit(TinyGPT(), loader(GPT_DATA, 8), loader(token_data(8, seed=1), 4))
    # The round trips that align the clocks of another host, run here on one (where the truth is 0).
    torch.save(clock_offsets(same_host_clock=False), Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_zero_bubble_and_v_schedules_match_one_device(tmp_path):
    torch.manual_seed(0)
    data = regression_data(N_SAMPLES)
    val = reference_loader(regression_data(16), 8)
    ref = fit(
        SequentialRegressor(),
        reference_loader(data, GLOBAL_BATCH),
        tmp_path / "ref",
        val_dataloaders=val,
        **TRAIN,
    )
    ref = ref[0]
    torch.manual_seed(0)
    gpt_val = reference_loader(token_data(8, seed=1), 4)
    gpt_ref = fit(
        TinyGPT(), reference_loader(GPT_DATA, 8), tmp_path / "gpt-ref", val_dataloaders=gpt_val, **TRAIN
    )[0]
    offsets = spawn_gloo(_job, WORLD, tmp_path)[0]
    for name in TRACED_V:
        _assert_as_on_one_device(tmp_path / f"traced-{name}", gpt_ref, name)
    assert offsets[0] == 0 and abs(offsets[1]) < 5_000_000, offsets  # within 5 ms of the one clock
    for name in CONFIGS:
        _assert_as_on_one_device(tmp_path / name, ref, name)
    for name in ONE_RANK:
        _assert_replicas_as_on_one_device(tmp_path / name, ref, name)
        # The replicas' all-reduce, started during the last backward, drawn on each rank's row (not
        # under the zero-bubble schedule, whose weight passes are not overlapped yet).
        records = torch.load(tmp_path / f"{name}-timeline.pt", weights_only=False)
        for r in records:
            spans = [e for e in r.events if e.category == "background"]
            overlapped = "zero_bubble" not in name
            assert [e.name for e in spans] == (["all-reduce bucket 0"] if overlapped else []), (name, r.rank)
            assert all(r.begin <= e.start < e.end <= r.end for e in spans), name
    # V placement: rank 0 holds the first and the last stage, rank 1 the two middle ones.
    plan = torch.load(tmp_path / "zbv-plan.pt", weights_only=False)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]
    assert "V placement: pipeline rank r holds stages r and 2p-1-r" in plan.format_table()
    rank0 = torch.load(tmp_path / "zbv" / "fit-rank0.pt")["params"]
    assert set(rank0) == {"layers.0.0.weight", "layers.0.0.bias", "layers.3.weight", "layers.3.bias"}
    for name in CONFIGS:
        _check_timeline(tmp_path, name)


def _assert_as_on_one_device(run_dir: Path, ref: dict, name: str) -> None:
    """Every weight, the per-step losses and the validation loss of a run equal one device's."""
    records = [torch.load(run_dir / f"fit-rank{r}.pt") for r in range(WORLD)]
    params = {k: v for r in records for k, v in r["params"].items()}
    assert_close_dicts(params, ref["params"], rtol=1e-5, atol=1e-6)
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6, msg=name)
    val_loss = records[0]["callback_metrics"]["val_loss"]
    assert val_loss == pytest.approx(ref["callback_metrics"]["val_loss"], rel=1e-5), name


def _assert_replicas_as_on_one_device(run_dir: Path, ref: dict, name: str) -> None:
    """Each replica's weights, the replicas' mean losses and validation loss equal one device's."""
    records = [torch.load(run_dir / f"fit-rank{r}.pt") for r in range(WORLD)]
    for r in records:
        assert_close_dicts(r["params"], ref["params"], rtol=1e-5, atol=1e-6)
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6, msg=name)
    val_loss = sum(r["callback_metrics"]["val_loss"] for r in records) / WORLD  # halves of equal size
    assert val_loss == pytest.approx(ref["callback_metrics"]["val_loss"], rel=1e-5), name


def _check_timeline(out: Path, name: str) -> None:
    records, writes = torch.load(out / f"{name}-timeline.pt", weights_only=False)
    assert sorted((r.step, r.rank) for r in records) == [(6, 0), (6, 1), (7, 0), (7, 1)], name
    # Rank 0 writes the files (after a gather) when the recorded run is over, never while a rank runs
    # a recorded batch: before, batch 6's chart held rank 0 back while rank 1 began batch 7, which
    # then read as rank 1's communication wait.
    for r in records:
        for start, end in writes:
            assert end <= r.begin or start >= r.end, (name, r.step, r.rank, "written in a recorded batch")
    assert len(writes) == 3, writes  # two charts, one trace
    for step, step_records in by_step(records).items():
        m = 2 if step == 7 else 4  # the short batch of 10 runs 2 micro-batches
        # Every stage ran the forward and the backward of every micro-batch once: B, or I then W.
        seen = Counter(
            (e.name, e.args["stage"], e.args["mb"])
            for r in step_records
            for e in r.events
            if e.category == "compute"
        )
        split = name != "1f1b" and any(k[0] == "W" for k in seen)
        assert (name in ("zbv", "interleaved_zero_bubble")) <= split, (name, seen)
        for stage in range(2 if name == "1f1b" else 4):
            for mb in range(m):
                assert seen[("F", stage, mb)] == 1, (name, stage, mb)
                assert seen[("B", stage, mb)] + min(seen[("I", stage, mb)], seen[("W", stage, mb)]) == 1
        # One clock: a stage's forward of a micro-batch starts after the previous stage's forward of it.
        start = {
            (e.args["stage"], e.args["mb"]): (e.start, e.end)
            for r in step_records
            for e in r.events
            if e.name == "F"
        }
        for (stage, mb), (begin, _) in start.items():
            if stage > 0:
                assert begin >= start[(stage - 1, mb)][1] - 200_000, (name, stage, mb)  # 0.2 ms slack
        names = {e.name for r in step_records for e in r.events}
        assert {"loss_fn", "log broadcast", "p2p post", "p2p wait"} <= names, names
        # Batch 7 ends an accumulation window (batches 6 and 7), batch 6 does not.
        assert ({"gradient sync", "optimizer step"} <= names) == (step == 7), (step, names)
        summary = summarize(step_records)
        assert summary.ideal is not None and 0 < summary.ideal <= summary.window, name
        assert summary.compute > 0 and summary.bubble >= 0 and summary.comm_wait >= 0
        assert abs(summary.compute + summary.bubble + summary.comm_wait + summary.other - 1) < 1e-9
        assert (out / name / "timeline" / f"step_{step}.png").stat().st_size > 10_000
    trace = json.loads((out / name / "timeline" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


def test_v_placement_is_torchs_and_a_conflicting_stages_per_rank_is_refused():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p in (1, 2, 3, 4):
        for style in ("v", "loop"):
            expected = generate_stage_to_rank_mapping(p, 2 * p, style=style)
            assert {s: stage_rank(s, p, 2 * p, style) for s in range(2 * p)} == expected
    assert PipelineStrategy(schedule="zbv").parallel_plan.stages_per_rank == 2
    assert PipelineStrategy(schedule="dualpipev", stages_per_rank=2).parallel_plan.stages_per_rank == 2
    assert PipelineStrategy(schedule="1f1b").parallel_plan.stages_per_rank == 1
    with pytest.raises(
        ValueError, match=r"schedule='zbv' runs exactly 2 stages per rank in a V .*stages_per_rank=3"
    ):
        PipelineStrategy(schedule="zbv", stages_per_rank=3)
    with pytest.raises(ValueError, match=r"stages_per_rank=1: drop stages_per_rank"):
        PipelineStrategy(schedule="dualpipev", stages_per_rank=1)
