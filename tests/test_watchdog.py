"""HangWatchdog: real hangs (gloo, spawn and the script launcher) become one report and a non-zero exit.

Each multi-process test hangs a real 2-rank run on purpose and checks that the report names the right
rank, state and line of user code, that every process is gone within timeout + 30 s, and that no
process is left behind. The diagnosis rules are tested on plain snapshots, without processes.
"""

import logging
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mp_harness import START_METHOD, ddp_spawn, free_port, process_lines, processes_with_env, quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import HangWatchdog, PipelineStrategy
from lightning_parallel.distributed import watchdog_frames, watchdog_state
from lightning_parallel.distributed.watchdog import Watchdog
from lightning_parallel.distributed.watchdog_report import diagnose, format_report
from lightning_parallel.distributed.watchdog_state import RankActivity, install_tracking, uninstall_tracking

JOB = Path(__file__).parent / "scripts" / "watchdog_job.py"
TIMEOUT = 3.0


def _line_of(marker: str, path: Path = Path(__file__)) -> int:
    """The line of ``path`` holding ``marker``: the report must point there."""
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


# ------------------------------------------------------------------------------ models that hang
def _hang_starts() -> None:
    """Touch the file the test names in LP_WATCHDOG_HANG_MARK: the hang begins now (its mtime)."""
    Path(os.environ["LP_WATCHDOG_HANG_MARK"]).touch()


class _RankOneBarrier(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == 1:
            _hang_starts()
            dist.barrier()  # <- unmatched barrier
        return super().training_step(batch, batch_idx)


class _RankZeroStuck(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 0:
            _hang_starts()
            time.sleep(600)  # <- rank 0 stuck
        return super().training_step(batch, batch_idx)


class _SlowEverywhere(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            time.sleep(2 * TIMEOUT)  # every rank: slow, not hung
        return super().training_step(batch, batch_idx)


# ------------------------------------------------------------------------------------ argument checks
@pytest.mark.parametrize("bad", [0, -1.5, float("nan"), timedelta(seconds=-3)])
def test_a_timeout_that_is_not_positive_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match=r"HangWatchdog\(timeout=.*\): timeout must be a positive"):
        HangWatchdog(timeout=bad)


def test_a_timeout_of_another_type_is_refused():
    with pytest.raises(TypeError, match=r"timeout='5'.*a number\) or a datetime.timedelta, got str"):
        HangWatchdog(timeout="5")


def test_a_timedelta_is_taken_in_seconds():
    assert HangWatchdog(timeout=timedelta(minutes=5)).timeout == 300.0


def test_a_single_process_does_nothing_and_says_so(caplog):
    original = dist.all_reduce
    assert not hasattr(original, "_lp_watchdog_original")  # importing the package patched nothing
    with caplog.at_level(logging.INFO):
        quiet_trainer(devices=1, max_steps=2, callbacks=[HangWatchdog(timeout=1)]).fit(
            SequentialRegressor(), loader(regression_data(16), 8)
        )
    assert "HangWatchdog: a single process cannot hang on its peers; the watchdog does nothing" in caplog.text
    assert dist.all_reduce is original


# ------------------------------------------------------------------------- tracking, one process
@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_tracking_counts_collectives_and_restores_torch_exactly(one_rank_group):
    originals = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "isend", "irecv")}
    activity = RankActivity()
    install_tracking(activity)
    try:
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object([None], {"a": 1})  # its inner all_gather is part of it, not counted
        work = dist.all_reduce(torch.ones(1), async_op=True)
        assert type(work).__name__ == "TrackedWork"
        work.wait()
        # torch checks `op in [isend, irecv]` against its own module: the pipeline's P2POps still build.
        op = dist.P2POp(dist.irecv, torch.zeros(1), 0)
        assert op.op is dist.distributed_c10d.irecv
        assert activity.counters == {"world": 3}
        assert activity.call is None and activity.snapshot()["kind"] == "computing"
    finally:
        uninstall_tracking(activity)
    assert {name: getattr(dist, name) for name in originals} == originals
    assert dist.distributed_c10d.all_reduce is originals["all_reduce"]


def test_inside_a_collective_the_snapshot_names_the_call_and_the_user_line(one_rank_group):
    activity = RankActivity()
    seen = {}

    def look(*args, **kwargs):  # stands in for torch's barrier: what the monitor sees meanwhile
        seen.update(activity.snapshot())

    spec = watchdog_state._Signature(dist.distributed_c10d.barrier)
    activity.enter_hook("training_step", step=4)
    activity.run("barrier", look, spec, (), {}, sys._getframe())  # <- snapshot site
    assert seen["kind"] == "collective" and seen["op"] == "barrier" and seen["seq"] == 1
    assert seen["site"].endswith(f"test_watchdog.py:{_line_of('# <- snapshot site')}")
    assert seen["hook"] == "training_step" and seen["step"] == 4


def test_user_code_is_everything_but_torch_lightning_this_package_and_the_stdlib():
    import lightning

    assert not watchdog_frames.is_library_file(__file__)
    for library in (torch.__file__, lightning.__file__, watchdog_state.__file__, os.__file__, "<string>"):
        assert watchdog_frames.is_library_file(library), library


# ----------------------------------------------------------------------------- diagnosis rules
def _view(rank, kind, **kw):
    base = dict(rank=rank, kind=kind, op=None, name=None, group="world", group_label="world")
    base.update(members=None, seq=None, p2p=[], site=None, hook="training_step", step=3, waiting=10.0)
    return {**base, "counters": {}, "where": None, **kw}


def _barrier(rank, seq=13, **kw):
    return _view(rank, "collective", op="barrier", name="barrier", seq=seq, site="train.py:42", **kw)


def _ddp(rank, **kw):
    return _view(
        rank, "untracked", op="DDP gradient all-reduce", group="untracked:ddp", seq=4, hook="backward", **kw
    )


def _diagnose(*views, silent=None, world=None):
    world = world or len(views)
    return diagnose({v["rank"]: v for v in views}, silent or {}, world, timeout=5.0, gone_after=10.0)


def test_a_collective_only_one_rank_called_is_a_rank_dependent_branch():
    verdict = _diagnose(_ddp(0, counters={"world": 12}), _barrier(1, counters={"world": 13}))
    assert verdict.text.startswith(
        "rank 1 called barrier at train.py:42 that no other rank called: a collective inside a "
        "rank-dependent branch (rank 0 waits in DDP gradient all-reduce (backward, step 3))"
    )
    assert verdict.stuck == (0, 1)


def test_a_rank_computing_while_its_peer_waits_has_not_reached_the_collective():
    stuck = _view(0, "computing", where="train.py:57", waiting=30.0)
    verdict = _diagnose(stuck, _ddp(1))
    assert verdict.text.startswith(
        "rank 0 has not reached a collective for 30 s: it is in train.py:57 (training_step, step 3)"
    )


def test_slow_steps_and_collectives_every_rank_is_in_are_not_hangs():
    assert _diagnose(_view(0, "computing", waiting=60.0), _view(1, "computing", waiting=60.0)) is None
    assert _diagnose(_barrier(0, waiting=60.0), _barrier(1, waiting=60.0)) is None
    assert _diagnose(_ddp(0, waiting=60.0), _ddp(1, waiting=60.0)) is None
    assert _diagnose(_view(0, "computing", waiting=1.0), _ddp(1, waiting=4.0)) is None  # under the timeout


def test_under_nccl_ranks_stalled_with_uneven_collective_counts_are_hung():
    """NCCL returns from a collective at once; the ranks then block at a sync, all "computing"."""
    behind = _view(0, "computing", counters={"world": 12}, waiting=9.0)
    ahead = _view(1, "computing", counters={"world": 13}, last_ops={"world": "all_reduce"}, waiting=9.0)
    verdict = _diagnose(behind, ahead)
    expected = "no rank has moved for 9 s and rank 1 issued all_reduce #13 on world that rank 0 did not"
    assert verdict.text.startswith(f"{expected} (it is at #12)")
    assert _diagnose(behind, {**ahead, "counters": {"world": 12}}) is None  # slow, not hung
    assert _diagnose(behind, {**ahead, "waiting": 2.0}) is None  # rank 1 still moves


def test_a_silent_rank_is_gone():
    verdict = _diagnose(_view(0, "computing"), _view(1, "computing"), silent={0: 0.5, 1: 12.0})
    assert verdict.gone == (1,)
    assert verdict.text.startswith("rank 1 is gone: no heartbeat for 12 s")


def test_a_pipeline_receive_from_a_computing_peer_and_a_mutual_receive():
    recv = _view(1, "p2p", op="pipeline recv from rank 0", p2p=[["recv", 0]], site="x.py:1")
    verdict = _diagnose(_view(0, "computing", where="train.py:9"), recv)
    assert "rank 0 has not reached a collective" in verdict.text
    assert "rank 1 waits in pipeline recv from rank 0" in verdict.text
    other = _view(0, "p2p", op="recv from rank 1", p2p=[["recv", 1]], site="y.py:2")
    assert "wait for each other" in _diagnose(other, recv).text
    sending = _view(0, "p2p", op="send to rank 1", p2p=[["send", 1]], site="y.py:2")
    assert _diagnose(sending, recv) is None  # a transfer in progress


def test_different_collectives_at_the_same_sequence_number_are_a_mismatch():
    reduce = _view(0, "collective", op="all_reduce", name="all_reduce", seq=13, site="a.py:1",
                   counters={"world": 13})  # fmt: skip
    verdict = _diagnose(reduce, _barrier(1, counters={"world": 13}))
    assert verdict.text.startswith("the ranks are in different collectives on world")


def test_the_report_has_a_row_per_rank_and_marks_user_frames():
    stack = [["train.py", 5, "main", "fit()", True], ["lightning/x.py", 9, "run", "", False]]
    views = {0: _ddp(0, stack=stack, pid=1, host="h"), 1: _barrier(1, stack=stack, pid=2, host="h")}
    verdict = diagnose(views, {}, 2, timeout=5.0, gone_after=10.0)
    report = format_report(verdict, views, {}, 2, timeout=5.0, exit_code=1)
    assert "diagnosis: rank 1 called barrier" in report
    assert "ranks 0, 1 (same stack):" in report and '  > File "train.py", line 5, in main' in report
    rows = [line for line in report.splitlines() if line[:2] in ("0 ", "1 ")]
    assert len(rows) == 2 and "train.py:42" in rows[1] and "#13" in rows[1]


def test_without_its_store_a_rank_that_waits_past_the_timeout_reports_rank_zero_gone(monkeypatch):
    """Rank 0 hosts the store: when it stops answering, a waiting rank can only judge itself."""
    watchdog = Watchdog(timeout=2.0, report_path=None)
    watchdog.rank, watchdog.world, watchdog._lost = 1, 2, "DistNetworkError: Broken pipe"
    emitted, exits = [], []
    monkeypatch.setattr(watchdog, "_emit", lambda report: emitted.append(report(False)))
    monkeypatch.setattr(watchdog, "_exit", lambda: exits.append(True))
    waiting = _barrier(1, waiting=1.0, stack=[["train.py", 42, "step", "dist.barrier()", True]])
    watchdog._judge_alone(waiting)
    assert emitted == [] and exits == []  # not yet past the timeout
    watchdog._judge_alone({**waiting, "waiting": 2.5})
    assert exits == [True]
    assert "diagnosis: rank 0 is gone: the watchdog store it hosted stopped answering" in emitted[0]
    assert "rank 1 has waited in barrier for 2 s" in emitted[0]


# ------------------------------------------------------------------------------- real hangs
def _marker(monkeypatch) -> str:
    """An environment entry the spawned ranks inherit: finds any of them left behind."""
    value = uuid.uuid4().hex
    monkeypatch.setenv("LP_WATCHDOG_TEST", value)
    return f"LP_WATCHDOG_TEST={value}"


def _assert_no_leftovers(marker: str, launched: list | None = None) -> None:
    """No process holding ``marker`` is left, nor any of the ``launched`` processes (a launcher's ranks).

    A rank forked from a forkserver started by an earlier test holds that server's environment, not the
    marker: its launcher's process list finds it instead.
    """
    deadline = time.monotonic() + 10  # a process that just exited may take a moment to be reaped

    def left() -> list[str]:
        alive = [f"{p.pid}: rank {i}" for i, p in enumerate(launched or []) if p.is_alive()]
        return process_lines(processes_with_env(marker)) + alive

    while (still := left()) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert still == [], f"processes of the hung run still alive: {still}"


def _assert_ended_in_time(mark: Path) -> None:
    """Every process exited within timeout + 30 s of the hang's start (the test runs once they have)."""
    assert mark.exists(), "the run never reached its hang"
    assert time.time() - mark.stat().st_mtime < TIMEOUT + 30


def _spawn_fit(model, tmp_path, monkeypatch, strategy=None, max_steps=6):
    """Fit 2 spawned ranks with the watchdog; return (error or None, report text or None)."""
    marker = _marker(monkeypatch)
    monkeypatch.setenv("LP_WATCHDOG_HANG_MARK", str(tmp_path / "hang-started"))
    report = tmp_path / "hang.txt"
    watchdog = HangWatchdog(timeout=TIMEOUT, report_path=report)
    strategy = strategy or ddp_spawn()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=max_steps, callbacks=[watchdog])
    error = None
    try:
        trainer.fit(model, loader(regression_data(), 8))
    except Exception as err:
        error = err
    _assert_no_leftovers(marker, trainer.strategy.launcher.procs)
    if error is not None:
        _assert_ended_in_time(tmp_path / "hang-started")
    return error, report.read_text() if report.exists() else None


def _diagnosis(report: str) -> str:
    return next(line for line in report.splitlines() if line.startswith("diagnosis: "))


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_barrier_only_rank_one_calls_under_ddp_spawn(tmp_path, monkeypatch, capfd):
    # spawn, not the suite's forkserver: a forkserver worker writes to the server's stderr, which
    # capfd does not see; the ranks' own messages are what this test reads.
    strategy = ddp_spawn(start_method="spawn")
    error, report = _spawn_fit(_RankOneBarrier(), tmp_path, monkeypatch, strategy=strategy)
    assert error is not None and "exit code 1" in str(error)
    line = _line_of("# <- unmatched barrier")
    assert (
        f"test_watchdog.py:{line} that no other rank called: a collective inside a rank-dependent branch"
        in (_diagnosis(report))
    )
    assert "rank 0 waits in DDP gradient all-reduce (backward, step 3)" in _diagnosis(report)
    err = capfd.readouterr().err
    assert err.count("HangWatchdog report") == 1 and "rank 1 exits with code 1" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_stuck_in_its_training_step(tmp_path, monkeypatch):
    error, report = _spawn_fit(_RankZeroStuck(), tmp_path, monkeypatch)
    assert error is not None and "exit code 1" in str(error)
    line = _line_of("# <- rank 0 stuck")
    assert _diagnosis(report).startswith("diagnosis: rank 0 has not reached a collective for ")
    assert f"it is in tests/test_watchdog.py:{line} (training_step, step 2)" in _diagnosis(report)
    assert "rank 1 waits in DDP gradient all-reduce" in _diagnosis(report)
    assert '  > File "tests/test_watchdog.py", line ' + str(line) in report  # rank 0's stack, marked


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_pipeline_stage_waits_in_recv_for_a_stuck_peer(tmp_path, monkeypatch):
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, start_method=START_METHOD)
    error, report = _spawn_fit(_RankZeroStuck(), tmp_path, monkeypatch, strategy=strategy)
    assert error is not None and "exit code 1" in str(error)
    line = _line_of("# <- rank 0 stuck")
    assert "rank 0 has not reached a collective" in _diagnosis(report)
    assert f"it is in tests/test_watchdog.py:{line} (training_step, step 2)" in _diagnosis(report)
    assert "rank 1 waits in pipeline recv from rank 0" in _diagnosis(report)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_step_longer_than_the_timeout_on_every_rank_is_not_reported(tmp_path, monkeypatch, capfd):
    start = time.monotonic()
    error, report = _spawn_fit(_SlowEverywhere(), tmp_path, monkeypatch, max_steps=3)
    assert error is None and report is None
    assert time.monotonic() - start > 2 * TIMEOUT  # the slow step did run
    assert "HangWatchdog report" not in capfd.readouterr().err


def _start_job(tmp_path, scenario: str, marker: str, **env: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(JOB.parents[2]), **env}
    env.update(LP_WATCHDOG_TEST=marker, LP_WATCHDOG_HANG_MARK=str(tmp_path / "hang-started"))
    command = [sys.executable, str(JOB), "--scenario", scenario, "--timeout", str(TIMEOUT)]
    command += ["--report", str(tmp_path / "hang.txt")]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen(command, env=env, cwd=tmp_path, **pipes)


def _finish(jobs: list[subprocess.Popen], marker: str) -> list[str]:
    """Every job's stderr, once all have exited; then no process of theirs may be left."""
    try:
        errors = [job.communicate(timeout=100)[1] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    _assert_no_leftovers(f"LP_WATCHDOG_TEST={marker}")
    return errors


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_barrier_only_rank_one_calls_under_the_script_launcher(tmp_path):
    marker = uuid.uuid4().hex
    job = _start_job(tmp_path, "barrier", marker)
    [stderr] = _finish([job], marker)
    assert job.returncode == 1, stderr[-3000:]
    _assert_ended_in_time(tmp_path / "hang-started")
    line = _line_of("dist.barrier()", JOB)
    report = (tmp_path / "hang.txt").read_text()
    assert f"watchdog_job.py:{line} that no other rank called" in _diagnosis(report)
    assert stderr.count("HangWatchdog report") == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_sigkilled_rank_is_reported_gone(tmp_path):
    """Ranks started by an outside launcher that does not end the others when one dies (as srun).

    (Lightning's own script launcher, spawn and torchrun on one node end the job themselves.)
    """
    marker, port = uuid.uuid4().hex, str(free_port())
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    ranks = [_start_job(tmp_path, "kill", marker, LOCAL_RANK=str(r), **env) for r in (0, 1)]
    stderr = _finish(ranks, marker)
    assert [rank.returncode for rank in ranks] == [1, -9], stderr[0][-3000:]
    _assert_ended_in_time(tmp_path / "hang-started")
    report = (tmp_path / "hang.txt").read_text()
    assert _diagnosis(report).startswith("diagnosis: rank 1 is gone: no heartbeat for ")
    rows = [line.split() for line in report.splitlines() if line[:2] in ("0 ", "1 ")]
    assert rows[1][1] == "gone" and rows[0][1] == "computing"
