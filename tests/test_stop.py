"""A stop is a stop: SIGTERM/SIGINT to the launcher, to every process of a job or to one rank ends the job.

The mechanics (distributed/stop.py, with distributed/launcher_death.py: a rank dies with its launcher)
run in tiny processes that load only that file; the launch paths run one real 2-rank PipelineStrategy job
each (tests/scripts/stop_job.py), all at once in one test: spawn, fork, forkserver (their launcher passes
the signal on: distributed/stop_forwarding.py), the script launcher (strategies/pipeline/script_launcher.py),
torchrun and SLURM's way (each rank started on its own).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from mp_harness import free_port

from lightning_parallel import PipelineStrategy
from lightning_parallel.distributed import stop
from lightning_parallel.io import atomic
from lightning_parallel.strategies.pipeline.stop import check_signal_internals

JOB = Path(__file__).parent / "scripts" / "stop_job.py"
STOP_PY = Path(stop.__file__)
GRACE = 4.0
# How soon after the signal every process of a stopped job must be gone: the grace period, then the
# processes' own exit, which takes up to ~12 s on 2 cores shared by seven jobs and another pytest
# worker. What the bound tells apart is a job that ends from one that hangs (forever, without the guard).
GONE_WITHIN = GRACE + 25


def test_lightning_still_has_the_signal_machinery_we_replace():
    assert check_signal_internals() == []


def test_a_grace_period_that_is_not_a_positive_duration_is_refused_with_its_value():
    with pytest.raises(ValueError, match=r"stop_grace_period.*positive and finite \(e.g. 30.0\), got -1"):
        PipelineStrategy(stop_grace_period=-1)
    with pytest.raises(TypeError, match="grace period must be seconds or a timedelta, got '30'"):
        PipelineStrategy(stop_grace_period="30")
    with pytest.raises(TypeError, match="did you mean 'stop_grace_period'"):
        PipelineStrategy(stop_grace_periods=3)
    assert PipelineStrategy(stop_grace_period=timedelta(minutes=1)).stop_grace_period == 60.0
    assert stop.exit_status(signal.SIGTERM) == 143
    # How a launcher reads its ranks' ends: stopped (128 + signal, or killed by it), or failed.
    statuses = [stop.stopped_status(c) for c in (143, -15, 130, -2, 1, -9, None)]
    assert statuses == [143, 143, 130, 130, None, None, None]


# --- the mechanics, in processes that load only distributed/stop.py (no torch: milliseconds) ----------
LOAD_STOP = f"""
import importlib.util, os, signal, sys, time, ctypes
spec = importlib.util.spec_from_file_location("stop", {str(STOP_PY)!r})
stop = importlib.util.module_from_spec(spec); spec.loader.exec_module(stop)
"""


def _python(code: str, **kwargs) -> subprocess.Popen:
    source = LOAD_STOP + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", source], text=True, **kwargs)


def test_a_process_whose_main_thread_cannot_act_on_sigterm_ends_after_the_grace_period():
    # The handler does nothing and the main thread sits in C: only the guard's thread can end it.
    child = _python(
        """
        stop.StopGuard(0.5, name="rank 7").start()
        signal.signal(signal.SIGTERM, lambda *a: None)
        print("ready", flush=True)
        while True:
            ctypes.CDLL(None).sleep(100)
        """,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout.readline() == "ready\n"
    start = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) == 143
    assert 0.4 < time.monotonic() - start < 5
    assert "rank 7: still running 0.5 s after SIGTERM (main thread at <string>" in child.stderr.read()


RANK = (
    LOAD_STOP
    + """
stop.StopGuard(30.0, launcher=int(sys.argv[1])).start()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
open(sys.argv[2], "w").write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""
)
START = """
import os, subprocess, sys, time
open(sys.argv[-1], "a").write(str(os.getpid()) + " ")
args = [a.replace("LAUNCHER", str(os.getpid())) for a in sys.argv[2:]]  # the outermost one is the launcher
subprocess.Popen([sys.executable, "-c", sys.argv[1], *args])
time.sleep(600)
"""


@pytest.mark.parametrize("via", ["parent-death signal", "launcher watch"])
def test_a_rank_dies_with_its_launcher(tmp_path, via):
    """The launcher is the rank's parent (spawn, fork, script) or not (forkserver: the server is)."""
    pid_file, starters = tmp_path / "rank.pid", tmp_path / "starters"
    # launcher -> rank, or launcher -> middle process -> rank (as launcher -> forkserver -> rank)
    rank = [RANK, "LAUNCHER", str(pid_file), str(starters)]
    command = [sys.executable, "-c", START, *rank]
    if via == "launcher watch":
        command = [sys.executable, "-c", START, START, *rank]
    launcher = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rank_pid = int(pid_file.read_text())
        launcher.kill()  # SIGKILL: the launcher runs no handler at all
        deadline = time.monotonic() + 10
        while _running(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(rank_pid), f"the rank outlived its launcher ({via})"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in starters.read_text().split() if starters.exists() else []:
            if int(pid) != launcher.pid and _running(int(pid)):
                os.kill(int(pid), signal.SIGKILL)  # the middle process


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


# --- every launch path: one real job each, all at once ------------------------------------------------
@dataclass
class Job:
    """One scenario: how the job is launched, what receives the signal, what must follow."""

    name: str
    start_method: str  # spawn, fork, forkserver, popen, torchrun, slurm
    target: str  # "launcher", "job" (every process: Ctrl-C in a terminal, `timeout`), "rank 1"
    signum: int = signal.SIGTERM
    block: bool = False  # the ranks sit in a collective when the signal comes
    slow: str = "last"  # the stage whose rank is slow (the other one waits for it in a pipeline receive)
    status: int | None = 143  # the launcher's (rank 0's) exit status; None: not ours to say (torchrun)
    saves: bool = False  # Lightning's own stop handling ran: the save_on_exception checkpoint exists
    says: str = ""  # in the output
    procs: list = field(default_factory=list)
    signalled: float = 0.0
    gone: float | None = None


JOBS = [
    Job("spawn: SIGTERM to every process (the issue's case)", "spawn", "job"),
    Job(
        "fork: SIGINT to the launcher (Lightning's KeyboardInterrupt path), first stage slow",
        "fork",
        "launcher",
        signal.SIGINT,
        slow="first",
        status=1,
    ),
    Job("fork: SIGTERM to rank 1 alone", "fork", "rank 1"),
    Job(
        "forkserver: SIGTERM to every process, ranks blocked in a collective",
        "forkserver",
        "job",
        block=True,
        says=f"rank 1: still running {GRACE:g} s after SIGTERM (main thread at distributed_c10d.py",
    ),
    Job("script launcher: SIGTERM to every process", "popen", "job", saves=True),
    # Ctrl-C: Python raised KeyboardInterrupt in the slow rank alone, which went on to its save while its
    # peer waited for it in a pipeline receive, until the grace period ended both (status 130, no save).
    # Each slow stage once (the first also in the fork job above; the agreement is tested alone below).
    Job("script launcher: Ctrl-C, last stage slow", "popen", "job", signal.SIGINT, status=1, saves=True),
    Job("torchrun: SIGTERM to every process", "torchrun", "job", status=None, saves=True),
    Job(
        "torchrun: Ctrl-C, first stage slow",
        "torchrun",
        "job",
        signal.SIGINT,
        slow="first",
        status=None,
        saves=True,
    ),
    Job("SLURM: SIGTERM to every rank", "slurm", "job", saves=True, says="Bypassing SIGTERM"),
]


def _processes_by_marker() -> dict[str, list[int]]:
    """The live processes of each job, by the ``LP_STOP_JOB`` marker in their environment (one /proc scan)."""
    found: dict[str, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        for entry in entries:
            if entry.startswith(b"LP_STOP_JOB="):
                found.setdefault(entry[12:].decode(), []).append(int(pid))
    return found


def _start(job: Job, out: Path, marker: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LP_STOP_JOB": marker}
    # the port Lightning's launcher in the job takes (find_free_network_port reads it): one of the suite's
    env["STANDALONE_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    method = "popen" if job.start_method in ("torchrun", "slurm") else job.start_method
    command = [str(JOB), "--out", str(out), "--start-method", method, "--grace", str(GRACE)]
    command += ["--slow", job.slow, *(["--block"] if job.block else [])]
    log = open(out / "log", "w")  # noqa: SIM115 (the job's processes write it after this returns)
    run = dict(stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=out)
    if job.start_method == "torchrun":
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *command]
    if job.start_method != "slurm":
        job.procs = [subprocess.Popen([sys.executable, *command], env=env, **run)]
        return
    slurm = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NODEID="0", SLURM_JOB_NAME="stop_job")
    slurm.update(SLURM_JOB_ID="4242", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for rank in (0, 1):  # srun starts every task itself
        task = {**env, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        job.procs.append(subprocess.Popen([sys.executable, *command], env=task, **run))


def _wait_for(jobs: list[Job], outs: dict[str, Path], names, what: str, seconds: float) -> None:
    """Wait until every job's ``out`` holds the files ``names(job)`` (markers its ranks write)."""
    deadline = time.monotonic() + seconds
    for job in jobs:
        out = outs[job.name]
        while not all((out / name).exists() for name in names(job)):
            assert time.monotonic() < deadline and job.procs[0].poll() is None, (
                f"{job.name} did not {what} within {seconds:.0f} s:\n{(out / 'log').read_text()[-3000:]}"
            )
            time.sleep(0.2)


def _trained(job: Job) -> list[str]:
    """The markers a job's ranks write once they go on after ``go``."""
    return ["blocked-rank1"] if job.block else ["training-rank0", "training-rank1"]


def _signal(job: Job, out: Path) -> None:
    launcher = job.procs[0]
    if job.target == "launcher":
        launcher.send_signal(job.signum)
    elif job.target == "rank 1":
        os.kill(int((out / "ready-rank1").read_text()), job.signum)
    else:
        for proc in job.procs:
            os.killpg(proc.pid, job.signum)  # as `timeout`, `kill -TERM -<pgid>` and schedulers do
    job.signalled = time.monotonic()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_stop_ends_every_process_of_the_job_on_every_launch_path(tmp_path):
    markers = {job.name: f"{tmp_path.name}-{i}" for i, job in enumerate(JOBS)}
    outs = {job.name: tmp_path / f"job{i}" for i, job in enumerate(JOBS)}
    try:
        for job in JOBS:
            outs[job.name].mkdir()
            _start(job, outs[job.name], markers[job.name])
        # Seven jobs start at once on 2 cores (with make test's other worker beside them): the imports of
        # their spawned ranks alone take minutes of CPU. How soon they start is not what this test checks.
        # A job that has started waits (asleep, not training) until every job has: then all go on at once.
        _wait_for(JOBS, outs, lambda job: [f"ready-rank{r}" for r in (0, 1)], "start training", 300)
        for job in JOBS:
            (outs[job.name] / "go").touch()
        # every job trains again (or, blocked, sits in its collective), then every signal goes out at once
        _wait_for(JOBS, outs, _trained, "go on training", 60)
        time.sleep(0.5)  # the blocked jobs' rank 1, past its marker, enters its lone barrier
        for job in JOBS:
            _signal(job, outs[job.name])
        deadline = time.monotonic() + GONE_WITHIN + 5
        while time.monotonic() < deadline and any(j.gone is None for j in JOBS):
            left = _processes_by_marker()
            for job in JOBS:
                ended = job.gone is None and all(p.poll() is not None for p in job.procs)
                if ended and not left.get(markers[job.name]):
                    job.gone = time.monotonic() - job.signalled
            time.sleep(0.1)
    finally:
        left = _processes_by_marker()
        for job in JOBS:
            for pid in left.get(markers[job.name], []):
                os.kill(pid, signal.SIGKILL)
    problems = []
    for job in JOBS:
        out, log = outs[job.name], (outs[job.name] / "log").read_text()
        statuses = [p.returncode for p in job.procs]
        if job.gone is None or job.gone > GONE_WITHIN:
            problems.append(
                f"{job.name}: processes left {job.gone} s after the signal (bound {GONE_WITHIN} s)"
            )
        if job.status is not None and set(statuses) != {job.status}:
            problems.append(f"{job.name}: exit status {statuses}, expected {job.status}")
        if job.says and job.says not in log:
            problems.append(f"{job.name}: the output does not say {job.says!r}")
        if job.saves:
            saved = list((out / "ckpt").glob("*.ckpt")) if (out / "ckpt").exists() else []
            if len(saved) != 1 or not atomic.verify_checkpoint(str(saved[0])).ok:
                problems.append(f"{job.name}: no verified checkpoint saved on the stop signal: {saved}")
        if problems and problems[-1].startswith(job.name):
            problems.append(f"--- {job.name} output:\n{log[-2500:]}")
    assert not problems, "\n".join(problems)
    print({job.name: round(job.gone or -1, 1) for job in JOBS})


class _Guard:
    """What a StopAgreement and its SIGINT handler use of a rank's stop guard (its first signal, noted)."""

    def __init__(self, signum: int | None = None) -> None:
        self.signum = signum

    def note(self, signum: int) -> None:
        self.signum = self.signum or signum


class _Trainer:
    """What StopAgreement sets on a trainer: Lightning's signal connector's flag."""

    def __init__(self) -> None:
        self._signal_connector = type("Connector", (), {"received_sigterm": False})()


def _returning(guard: _Guard):
    """A stand-in for ``current_guard``: this rank's guard has seen a signal."""
    return lambda: guard


# Which rank is signalled, with what, after batch ``at``'s agreement was posted; 5 batches, then finish.
AGREEMENTS = {
    "SIGTERM to rank 1": ({1: signal.SIGTERM}, 2),
    "SIGINT to rank 1": ({1: signal.SIGINT}, 2),
    "SIGINT to rank 0, SIGTERM to rank 1": ({0: signal.SIGINT, 1: signal.SIGTERM}, 2),
    "SIGINT to rank 0 in the last batch but one": ({0: signal.SIGINT}, 3),
}


def _agreement_worker(rank: int, world: int, out_dir: str) -> None:
    """Each case: the signal arrives after batch ``at``'s agreement was posted; batch ``at + 1`` posts it,
    and every rank acts at batch ``at + 2``'s start (read a batch after it was posted), none earlier:
    Lightning's stop flag rises (SIGTERM), or a StopInterrupt is raised (SIGINT), in ``finish`` if
    training ends first."""
    import torch

    from lightning_parallel.strategies.pipeline import stop as strategy_stop

    results = {}
    for case, (signals, at) in AGREEMENTS.items():
        strategy_stop.current_guard = lambda: None
        agreement, trainer = strategy_stop.StopAgreement(), _Trainer()
        result = {"flag_at": None, "interrupted_at": None, "agreed": None}
        try:
            for batch in range(5):
                result["interrupted_at"] = batch
                agreement.at_batch(trainer)
                if trainer._signal_connector.received_sigterm and result["flag_at"] is None:
                    result["flag_at"] = batch
                if rank in signals and batch == at:
                    strategy_stop.current_guard = _returning(_Guard(signals[rank]))
            result["interrupted_at"] = "finish"
            result["agreed"] = agreement.finish()
            result["interrupted_at"] = None
        except strategy_stop.StopInterrupt:
            result["agreed"] = agreement.signum
        results[case] = result
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_rank_stops_in_the_same_batch_read_a_batch_after_it_was_posted(tmp_path):
    from mp_harness import spawn_gloo

    ranks = spawn_gloo(_agreement_worker, 2, tmp_path)
    for case, result in ranks[0].items():
        assert ranks[1][case] == result, f"{case}: the ranks disagree: {ranks[0][case]} {ranks[1][case]}"
    term, sigint = signal.SIGTERM, signal.SIGINT
    assert ranks[0] == {
        # posted at batch 3 (rank 1's signal), read at 4: Lightning's flag rises, it stops the batch's end
        "SIGTERM to rank 1": {"flag_at": 4, "interrupted_at": None, "agreed": term},
        # ... or every rank raises Lightning's KeyboardInterrupt there, before the batch's pipeline
        "SIGINT to rank 1": {"flag_at": None, "interrupted_at": 4, "agreed": sigint},
        # two signals: the highest (SIGTERM) on every rank
        "SIGINT to rank 0, SIGTERM to rank 1": {"flag_at": 4, "interrupted_at": None, "agreed": term},
        # posted in the last batch: read as training ends
        "SIGINT to rank 0 in the last batch but one": {
            "flag_at": None,
            "interrupted_at": "finish",
            "agreed": sigint,
        },
    }


def test_while_fitting_sigint_is_noted_for_the_agreement_and_given_back_to_python_after(monkeypatch):
    """A Ctrl-C while fitting is noted, not raised where it lands; after training Python's handler is back,
    and a Ctrl-C that came too late for a vote is raised then (no process group: nothing to agree on)."""
    from lightning_parallel.strategies.pipeline import stop as strategy_stop

    guard, trainer = _Guard(), type("Trainer", (), {"local_rank": 0})()
    monkeypatch.setattr(strategy_stop, "current_guard", lambda: guard)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        agreement = strategy_stop.StopAgreement()
        agreement.start(trainer)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # what a Ctrl-C runs now: no KeyboardInterrupt
        assert guard.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            agreement.finish()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # a handler of the user's stays theirs
        users = lambda *args: None  # noqa: E731
        signal.signal(signal.SIGINT, users)
        agreement.start(trainer)
        assert signal.getsignal(signal.SIGINT) is users
        assert agreement.release() is False
    finally:
        signal.signal(signal.SIGINT, previous)
