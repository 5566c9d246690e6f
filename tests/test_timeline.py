"""The pipeline timeline without processes: the torch names it wraps, the ideal, the summary, the files.

Covers callbacks/timeline.py's argument and strategy checks (its recording: test_pipeline_schedules.py)
and the observer it registers with strategies/pipeline/step_state.py.
"""

import inspect
import json

import pytest
from mp_harness import quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

from lightning_parallel import PipelineTimeline
from lightning_parallel.strategies.pipeline.step_state import StepState
from lightning_parallel.timeline import _torch_hooks as _timeline_hooks
from lightning_parallel.timeline.recorder import Event, StepRecord, Timeline
from lightning_parallel.timeline.report import chrome_trace, ideal_makespan, summarize, write_gantt

MS = 1_000_000


def test_the_private_torch_names_the_timeline_wraps_are_where_torch_2_13_keeps_them():
    """If this fails, torch moved them: update timeline/_torch_hooks.py (its docstring says what)."""
    params = {
        n: list(inspect.signature(getattr(_PipelineStageBase, n)).parameters)
        for n in _timeline_hooks.STAGE_METHODS
    }
    assert params["forward_one_chunk"][:2] == ["self", "fwd_chunk_id"]
    assert params["backward_one_chunk"][:4] == ["self", "bwd_chunk_id", "loss", "full_backward"]
    assert params["backward_weight_one_chunk"][:2] == ["self", "bwd_chunk_id"]
    assert list(inspect.signature(schedules._batch_p2p).parameters) == ["p2p_ops", "desc"]
    assert list(inspect.signature(schedules._wait_batch_p2p).parameters) == ["work"]
    # The schedules call them as module globals (so swapping the module attribute reaches them).
    source = inspect.getsource(schedules._PipelineScheduleRuntime._step_microbatches)
    assert "_wait_batch_p2p(" in source and "_batch_p2p(" in source and "forward_one_chunk(" in source
    assert "_wait_batch_p2p(" in inspect.getsource(schedules.Schedule1F1B._step_microbatches)


def test_the_private_torch_names_of_the_v_forward_schedule_are_where_torch_2_13_keeps_them():
    """If this fails, torch moved them: update pipeline/_v_forward.py (its docstring says what)."""
    for name in (
        "_PipelineScheduleRuntime",
        "_Action",
        "_ComputationType",
        "_add_unshard_reshard",
        "_add_send_recv",
    ):
        assert hasattr(schedules, name), name
    assert list(inspect.signature(schedules._add_send_recv).parameters) == [
        "compute_actions",
        "stage_to_rank",
        "num_stages",
    ]
    assert "pipeline_order_with_comms" in inspect.getsource(
        schedules._PipelineScheduleRuntime._step_microbatches
    )
    assert schedules._ComputationType.FORWARD and list(schedules._Action._fields)[:3] == [
        "stage_index", "computation_type", "microbatch_index"]  # fmt: skip


def test_patched_times_the_calls_and_puts_the_originals_back():
    before = [getattr(_PipelineStageBase, n) for n in _timeline_hooks.STAGE_METHODS]
    wait = schedules._wait_batch_p2p
    timeline = Timeline()
    timeline.begin_step(0)
    with timeline.torch_schedule():
        assert schedules._wait_batch_p2p is not wait
        schedules._wait_batch_p2p([])
    timeline.end_step()
    assert [getattr(_PipelineStageBase, n) for n in _timeline_hooks.STAGE_METHODS] == before
    assert schedules._wait_batch_p2p is wait
    (record,) = timeline.gather()
    assert [(e.name, e.category) for e in record.events] == [("p2p wait", "wait")]
    # Outside a recorded step nothing is wrapped.
    with timeline.torch_schedule():
        assert schedules._wait_batch_p2p is wait


def _compute(name, stage, mb, start, end):
    return Event(name, "compute", start * MS, end * MS, {"stage": stage, "mb": mb})


def _gpipe_like_step():
    """p=2, m=2: forward 1 ms, backward 2 ms, and a 1 ms P2P latency each way (rank 1 waits)."""
    rank0 = [
        _compute("F", 0, 0, 0, 1),
        _compute("F", 0, 1, 1, 2),
        _compute("B", 0, 0, 6, 8),
        _compute("B", 0, 1, 9, 11),
    ]
    rank1 = [Event("p2p wait", "wait", 0, 2 * MS), _compute("F", 1, 0, 2, 3), _compute("B", 1, 0, 3, 5),
             _compute("F", 1, 1, 5, 6), _compute("B", 1, 1, 6, 8),
             Event("optimizer step", "optimizer", 8 * MS, 11 * MS)]  # fmt: skip
    return [StepRecord(0, 0, "stage 0", 0, 11 * MS, rank0), StepRecord(0, 1, "stage 1", 0, 11 * MS, rank1)]


def test_the_steps_observe_a_registered_timeline_only_while_it_records():
    state, timeline, other = StepState(), Timeline("stage 0"), Timeline("stage 1")
    state.register(timeline)
    assert state.observer is None  # registered, not recording: the steps time nothing
    timeline.begin_step(5)
    assert state.observer is timeline
    state.unregister(other)  # (not the registered one: nothing changes)
    assert state.observer is timeline
    timeline.end_step()
    assert state.observer is None
    timeline.begin_step(6)
    state.unregister(timeline)
    assert state.observer is None and state.channels == {} and state.predict_batches is None


def test_the_ideal_replays_the_recorded_order_with_free_communication():
    records = _gpipe_like_step()
    # rank 0: F0 0-1, F1 1-2; rank 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7; rank 0: B0 4-6, B1 7-9.
    assert ideal_makespan(records) == pytest.approx(9e-3)
    s = summarize(records)
    assert s.window == pytest.approx(11e-3) and s.compute == pytest.approx(12 / 22)
    assert s.bubble == pytest.approx((18 - 12) / 22)  # 2 x 9 ms less the 12 ms of compute
    assert s.comm_wait == 0 and s.other == pytest.approx(4 / 22)
    assert "compute 55%, bubble 27% (schedule's ideal)" in s.line()
    # Two replicas (ranks 2 and 3 run the same stages on other data): each replays on its own.
    twins = [StepRecord(0, r.rank + 2, r.label, r.begin, r.end, r.events, replica=1) for r in records]
    both = summarize(records + twins)
    assert (both.compute, both.bubble, both.other) == pytest.approx((s.compute, s.bubble, s.other))
    # A span beside the others (an overlapped all-reduce) is drawn on a row of its own, not added up.
    records[0].events.append(Event("all-reduce bucket 0", "background", 2_000_000, 9_000_000))
    assert summarize(records).line() == s.line()
    trace = chrome_trace(records)
    assert [e["tid"] for e in trace["traceEvents"] if e["name"] == "all-reduce bucket 0"] == [2]
    # An order the dependencies cannot replay has no ideal, rather than a wrong one.
    records[0].events[0].args["stage"] = 1
    assert ideal_makespan(records) is None


def test_the_trace_has_a_track_per_rank_and_the_chart_is_written(tmp_path):
    records = _gpipe_like_step()
    trace = chrome_trace(records)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0 (stage 0)", "rank 1 (stage 1)"}
    assert {"F0 s1", "B1 s0", "p2p wait", "optimizer step"} <= {e["name"] for e in trace["traceEvents"]}
    json.dumps(trace)
    assert write_gantt(records, tmp_path / "step.png").stat().st_size > 10_000


def test_pipeline_timeline_checks_its_arguments_and_the_strategy(tmp_path):
    with pytest.raises(ValueError, match=r"steps must be a non-empty list of batch indices >= 0, got \[-1\]"):
        PipelineTimeline(steps=[-1])
    trainer = quiet_trainer(devices=1, max_steps=1, callbacks=[PipelineTimeline()], default_root_dir=tmp_path)
    with pytest.raises(
        ValueError, match=r"PipelineTimeline records the schedule of PipelineStrategy, but the Trainer runs"
    ):
        trainer.fit(SequentialRegressor(), loader(regression_data(8), 4))
