"""The hang watchdog's monitor: each rank says where it is, the lowest live rank judges, one report, all exit.

Each rank runs one daemon thread. About once a second it publishes this rank's snapshot (see
:mod:`~lightning_parallel.distributed.watchdog_state`) and heartbeat to an out-of-band store, reads the
verdict, and, on the lowest rank still alive (the judge), reads every snapshot and applies
:func:`~lightning_parallel.distributed.watchdog_report.diagnose`. On a hang the judge prints one report
to stderr (and to ``report_path``), posts the verdict, and every rank leaves with ``os._exit``: the main
thread is wedged in a collective and can neither raise nor return. Pure PyTorch (no Lightning import).

Why a TCPStore of its own: the report must travel while the process group is wedged, so never through a
collective on it. Rank 0 hosts a ``torch.distributed.TCPStore`` (a C++ server thread that keeps answering
while Python is blocked) and announces its port once, through a collective at start while the group is
healthy; this uses only public API, unlike reaching for the rendezvous store. The cost: a few small
store operations per rank per second, and one ``multi_get`` of every rank's snapshot on the judge.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_parallel.distributed.agree import decide_on, distributed_ready
from lightning_parallel.distributed.watchdog_frames import main_thread_stack
from lightning_parallel.distributed.watchdog_report import WAITING_KINDS, Diagnosis, diagnose, format_report
from lightning_parallel.distributed.watchdog_state import RankActivity, install_tracking, uninstall_tracking

__all__ = ["EXIT_CODE", "Watchdog", "check_timeout"]

EXIT_CODE = 1
"""The exit status of every process after a hang report."""


def check_timeout(timeout: float | timedelta, owner: str = "HangWatchdog") -> float:
    """``timeout`` in seconds, or a clear error for anything that is not a positive, finite duration.

    Example::

        check_timeout(timedelta(minutes=5))   # 300.0
    """
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(
            f"{owner}(timeout={timeout!r}): timeout must be seconds (a number) or a datetime.timedelta, "
            f"got {type(timeout).__name__}"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{owner}(timeout={timeout!r}): timeout must be a positive, finite number of seconds "
            f"(e.g. timeout=300.0 or timedelta(minutes=5))"
        )
    return float(seconds)


class _StoreLost(Exception):
    """The watchdog store stopped answering (its host, rank 0, is gone, or the network is)."""


class _Channel:
    """The out-of-band store: one key per rank's snapshot, the verdict, and the exit acknowledgements."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._present: set[str] = set()

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, OSError) as err:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
            raise _StoreLost(f"{type(err).__name__}: {err}") from err

    def publish(self, rank: int, view: dict[str, Any]) -> None:
        self._call("set", f"state/{rank}", json.dumps(view))

    def read(self, ranks: range | list[int]) -> dict[int, dict[str, Any]]:
        # multi_get blocks on a missing key until the store timeout: ask only for keys known to exist.
        keys = [f"state/{r}" for r in ranks]
        present = [k for k in keys if k in self._present or self._exists(k)]
        values = self._call("multi_get", present) if present else []
        return {int(k.split("/")[1]): json.loads(v) for k, v in zip(present, values)}

    def _exists(self, key: str) -> bool:
        if self._call("check", [key]):
            self._present.add(key)
            return True
        return False

    def verdict(self) -> dict[str, Any] | None:
        raw = self._call("get", "verdict")
        return json.loads(raw) if raw else None

    def claim(self, verdict: dict[str, Any]) -> bool:
        """Post ``verdict`` unless another rank posted one first: exactly one report per hang."""
        payload = json.dumps(verdict)
        return self._call("compare_set", "verdict", "", payload) == payload.encode()

    def ack(self) -> int:
        return int(self._call("add", "acks", 1))

    def acks(self) -> int:
        return int(self._call("add", "acks", 0))


class Watchdog:
    """One rank's hang watchdog: start it on every rank of a healthy process group, stop it at the end.

    Args:
        timeout: seconds a rank may wait in a communication its partners are not in.
        report_path: also write the report to this file (on the reporting rank's machine).
        on_exit: called just before this process exits after a hang (e.g. to kill launched children).
        exit_code: the exit status after a hang.

    Example::

        watchdog = Watchdog(timeout=300.0)
        watchdog.start()                       # a collective: on every rank at the same point
        watchdog.activity.enter_hook("training_step", step=0)
        ...
        watchdog.stop()
    """

    def __init__(
        self,
        timeout: float,
        report_path: str | None = None,
        on_exit: Callable[[], None] | None = None,
        exit_code: int = EXIT_CODE,
    ) -> None:
        self.timeout = check_timeout(timeout, "Watchdog")
        self.report_path, self.on_exit, self.exit_code = report_path, on_exit, exit_code
        # A heartbeat and a look at the verdict every second; faster for short (test) timeouts.
        self.period = min(1.0, max(0.1, self.timeout / 5))
        # A heartbeat can pause while the main thread holds the GIL in a long C call: a rank is gone
        # only after the timeout itself plus a margin, still well inside the promised timeout + 30 s.
        self.gone_after = self.timeout + 5.0
        self.activity = RankActivity()
        self.rank, self.world, self.backend = 0, 1, "gloo"
        self._server: dist.TCPStore | None = None
        self._channel: _Channel | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._beat = 0
        self._last_token: tuple[int, int] | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._lost: str | None = None

    # ------------------------------------------------------------------------------ start / stop
    def start(self) -> None:
        """Open the channel (a collective on the default group) and start watching this rank."""
        if not distributed_ready():
            raise RuntimeError("Watchdog.start() needs an initialised torch.distributed process group")
        self.rank, self.world, self.backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        host, port = decide_on(0, self._host_store)
        store = self._server if self._server is not None else _connect(host, port)
        self._channel = _Channel(store)
        self._channel.publish(self.rank, self._view())
        install_tracking(self.activity)
        self._thread = threading.Thread(target=self._loop, name="lightning_parallel-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; rank 0 keeps its store up until the other ranks stopped too (a few seconds)."""
        if self._thread is None:
            return
        uninstall_tracking(self.activity)
        self._stopping.set()
        self._thread.join(timeout=self.period + 30)
        self._thread = None
        if self._channel is not None and self._lost is None:
            try:
                self._channel.publish(self.rank, {**self._view(), "stopped": True})
                if self._server is not None:
                    self._wait_for_others_to_stop(deadline=time.monotonic() + min(5.0, self.timeout))
            except _StoreLost:
                pass
        self._channel, self._server = None, None

    def await_verdict(self) -> bool:
        """Block while the watchdog may still find a rank gone (``gone_after`` and two periods).

        For a rank whose collective failed because a peer died: the judge then reports that peer as
        gone and every rank exits with the report, instead of each with its own communication error.
        It returns at once when a peer stopped watching (that peer left with an error of its own,
        which explains this one), or without the store. Returns False if no verdict came (the
        process exits on a verdict; this never returns then).
        """
        if self._thread is None or self._channel is None:
            return False
        deadline = time.monotonic() + self.gone_after + 2 * self.period + 2.0
        while time.monotonic() < deadline and self._thread.is_alive() and self._lost is None:
            try:
                views = self._channel.read([r for r in range(self.world) if r != self.rank])
            except _StoreLost:
                return False
            if any(v.get("stopped") for v in views.values()):
                return False
            time.sleep(self.period)
        return False

    def _host_store(self) -> tuple[str, int]:
        # Every rank already reaches MASTER_ADDR (where rank 0 runs under Lightning's launchers,
        # torchrun and SLURM); the server listens on all interfaces.
        host = os.environ.get("MASTER_ADDR") or socket.getfqdn()
        server = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
        server.set("verdict", "")
        server.add("acks", 0)
        self._server = server
        return host, int(server.port)

    def _wait_for_others_to_stop(self, deadline: float) -> None:
        assert self._channel is not None
        while time.monotonic() < deadline:
            views = self._channel.read(range(self.world))
            if len(views) == self.world and all(v.get("stopped") for v in views.values()):
                return
            time.sleep(0.05)

    # ---------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        failed = False
        while not self._stopping.wait(self.period):
            try:
                self._tick()
            except _StoreLost as err:
                self._lost = self._lost or str(err)
            except Exception as err:
                # A bug here must never take training down, nor make this rank look gone to the
                # others: say it once, and keep the heartbeat going with a snapshot that never hangs.
                if not failed:
                    _say(f"HangWatchdog on rank {self.rank}: {type(err).__name__}: {err}; it keeps watching")
                failed = True
                self._heartbeat_only()

    def _heartbeat_only(self) -> None:
        self._beat += 1
        view = {"rank": self.rank, "beat": self._beat, "kind": "computing", "waiting": 0.0, "hook": "?"}
        view.update(step=None, op=None, name=None, seq=None, p2p=[], site=None, counters={})
        with contextlib.suppress(Exception):
            assert self._channel is not None
            self._channel.publish(self.rank, view)

    def _tick(self) -> None:
        view = self._view()
        if self._lost is not None:
            self._judge_alone(view)
            return
        assert self._channel is not None
        self._channel.publish(self.rank, view)
        verdict = self._channel.verdict()
        if verdict is not None:
            self._leave(verdict, reporter=False)
        if self._judge() == self.rank:
            self._judge_all()

    def _view(self) -> dict[str, Any]:
        """This rank's snapshot, with the main thread's stack once it has stayed put for a period."""
        activity = self.activity
        token = (id(activity.call), id(activity.hook))
        view = activity.snapshot()
        self._beat += 1
        view.update(
            rank=self.rank, beat=self._beat, pid=os.getpid(), host=socket.gethostname(), backend=self.backend
        )
        if token == self._last_token:
            stack = main_thread_stack()
            user = [f for f in stack if f[4]] or stack[-1:]
            view.update(stack=stack, where=f"{user[-1][0]}:{user[-1][1]}" if user else None)
        self._last_token = token
        return view

    # ------------------------------------------------------------------------------- judging
    def _judge(self) -> int:
        """The lowest rank that is alive and watching (this rank when all below it are gone)."""
        assert self._channel is not None
        now = time.monotonic()
        for j in range(self.rank):
            view = self._channel.read([j]).get(j)
            self._note(j, view, now)
            if view is not None and not view.get("stopped") and self._silent(j, now) <= self.gone_after:
                return j
        return self.rank

    def _note(self, rank: int, view: dict[str, Any] | None, now: float) -> None:
        # Silence is measured on this rank's own clock: no clock skew between machines.
        beat = -1 if view is None else int(view["beat"])
        if rank not in self._seen or self._seen[rank][0] != beat:
            self._seen[rank] = (beat, now)

    def _silent(self, rank: int, now: float) -> float:
        return now - self._seen[rank][1]

    def _judge_all(self) -> None:
        assert self._channel is not None
        now = time.monotonic()
        views = self._channel.read(range(self.world))
        for r in range(self.world):
            self._note(r, views.get(r), now)
        silent = {r: self._silent(r, now) for r in range(self.world)}
        diagnosis = diagnose(views, silent, self.world, self.timeout, self.gone_after)
        if diagnosis is None:
            return
        alive = [
            r for r in range(self.world) if r not in diagnosis.gone and not views.get(r, {}).get("stopped")
        ]
        verdict = {"reporter": self.rank, "text": diagnosis.text, "alive": alive}
        if not self._channel.claim(verdict):
            return  # another rank reported first: its verdict is read at the next tick
        self._emit(
            lambda full: format_report(
                diagnosis, views, silent, self.world, self.timeout, self.exit_code, full
            )
        )
        self._leave(verdict, reporter=True)

    def _judge_alone(self, view: dict[str, Any]) -> None:
        """Without the store, this rank can only judge itself: a long wait now means rank 0 is gone."""
        if view["kind"] not in WAITING_KINDS or view["waiting"] <= self.timeout:
            return
        text = (
            f"rank 0 is gone: the watchdog store it hosted stopped answering ({self._lost}), and rank "
            f"{self.rank} has waited in {view['op']} for {view['waiting']:.0f} s"
        )
        views = {self.rank: {**view, "stack": view.get("stack") or main_thread_stack()}}
        diagnosis = Diagnosis(text, gone=(0,))
        self._emit(
            lambda full: format_report(diagnosis, views, {}, self.world, self.timeout, self.exit_code, full)
        )
        self._exit()

    # ---------------------------------------------------------------------------------- leaving
    def _emit(self, report: Callable[[bool], str]) -> None:
        """The compact report on stderr; the one with every frame in ``report_path``."""
        _say(report(False), end="")
        if self.report_path:
            try:
                with open(self.report_path, "w") as f:
                    f.write(report(True))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:
                _say(f"HangWatchdog could not write the report to {self.report_path!r}: {err}")

    def _leave(self, verdict: dict[str, Any], reporter: bool) -> None:
        """Acknowledge the verdict and exit; rank 0 (the store's host) leaves last, so all can read it."""
        assert self._channel is not None
        if not reporter:
            _say(f"HangWatchdog: rank {self.rank} exits with code {self.exit_code} (hang reported by rank "
                 f"{verdict['reporter']})")  # fmt: skip
        try:
            self._channel.ack()
            deadline = time.monotonic() + 5 * self.period + 2.0
            while self._server is not None and time.monotonic() < deadline:
                if self._channel.acks() >= len(verdict["alive"]):
                    break
                time.sleep(0.05)
        except _StoreLost:
            pass
        self._exit()

    def _exit(self) -> None:
        if self.on_exit is not None:
            try:
                self.on_exit()
            except Exception as err:
                _say(f"HangWatchdog: on_exit failed: {type(err).__name__}: {err}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.exit_code)


def _connect(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=30), wait_for_workers=False)


def _say(text: str, end: str = "\n") -> None:
    """Write to stderr now (the process may ``os._exit`` next), also where sys.stderr is not a terminal."""
    try:
        sys.stderr.write(text + end)
        sys.stderr.flush()
    except Exception:
        os.write(2, (text + end).encode())
