"""Where this rank is now: inside a communication (which, on which group, from which user line) or computing.

The main thread pays for a few in-memory fields per collective and nothing else: the watchdog's monitor
thread turns them into a published snapshot about once a second, resolving the user's call site from the
caller's frame and reading the main thread's stack only then. Pure PyTorch (no Lightning import).

Tracking wraps the public ``torch.distributed`` functions (in ``torch.distributed`` and in
``torch.distributed.distributed_c10d``, so that ``dist.P2POp(dist.isend, ...)`` built by the pipeline
schedules still passes torch's own ``op in [isend, irecv]`` check) while a watchdog runs; collectives
issued from C++ (DDP's gradient all-reduce) are invisible and are described from the Lightning hooks.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_parallel.distributed.watchdog_frames import user_site

__all__ = ["COLLECTIVES", "POINT_TO_POINT", "RankActivity", "install_tracking", "uninstall_tracking"]

POINT_TO_POINT = (
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
)
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list",
)  # fmt: skip
_RECEIVES = frozenset({"recv", "irecv", "recv_object_list"})
_ASYNC_ALWAYS = frozenset({"isend", "irecv", "batch_isend_irecv"})


class Call:
    """One communication this rank's main work is inside: issued, or waited on through its Work.

    Example::

        activity.call.label()   # "barrier", "pipeline recv from rank 0", "all_reduce (wait)"
    """

    __slots__ = ("frame", "group", "op", "p2p", "pipeline", "seq", "since", "waits")

    def __init__(self, op: str, group: _Group, seq: int | None, p2p: tuple, frame: FrameType | None) -> None:
        self.op, self.group, self.seq, self.p2p, self.frame = op, group, seq, p2p, frame
        # Issued by torch.distributed.pipelining: the report says "pipeline recv from rank R".
        self.pipeline = frame is not None and frame.f_globals.get("__name__", "").startswith(
            "torch.distributed.pipelining"
        )
        self.since = time.monotonic()
        self.waits = False

    def waited(self, frame: FrameType | None) -> Call:
        """The same communication, now blocking in ``Work.wait()`` called from ``frame``."""
        call = Call(self.op, self.group, self.seq, self.p2p, frame)
        call.pipeline, call.waits = call.pipeline or self.pipeline, True
        return call

    def label(self) -> str:
        """``barrier``, ``pipeline recv from rank 0``, ``all_reduce (wait)``."""
        if not self.p2p:
            return f"{self.op} (wait)" if self.waits else self.op
        parts = [f"{d} {'from' if d == 'recv' else 'to'} {_peer(p)}" for d, p in self.p2p]
        return ("pipeline " if self.pipeline else "") + " + ".join(parts)


class Hook:
    """The Lightning hook this rank last entered, and an untracked collective it runs (DDP's backward).

    Example::

        Hook("backward", step=3, waits_in="DDP gradient all-reduce", seq=4)
    """

    __slots__ = ("name", "seq", "since", "step", "waits_in")

    def __init__(self, name: str, step: int | None, waits_in: str | None = None, seq: int | None = None):
        self.name, self.step, self.waits_in, self.seq = name, step, waits_in, seq
        self.since = time.monotonic()


class _Group:
    __slots__ = ("label", "name", "ranks")

    def __init__(self, name: str, ranks: tuple[int, ...] | None, label: str) -> None:
        # ranks is None for the default group (every rank): a 1000-rank list is not sent every second.
        self.name, self.ranks, self.label = name, ranks, label


class RankActivity:
    """What this process is doing, as cheap in-memory fields; :meth:`snapshot` makes them a dict.

    Example::

        activity = RankActivity()
        install_tracking(activity)              # dist.* calls now set activity.call while they run
        activity.enter_hook("training_step", step=3)
        activity.snapshot()["kind"]             # "computing", or "collective" inside dist.barrier()
        uninstall_tracking()
    """

    def __init__(self) -> None:
        self.call: Call | None = None
        self.hook = Hook("setup", None)
        self.counters: dict[str, int] = {}
        self.last_ops: dict[str, str] = {}
        self._groups: dict[int, _Group] = {}
        self._untracked_seq = 0

    def enter_hook(self, name: str, step: int | None = None, waits_in: str | None = None) -> None:
        """Record that the main thread entered a Lightning hook; ``waits_in`` names a C++ collective in it."""
        seq = None
        if waits_in is not None:
            self._untracked_seq += 1
            seq = self._untracked_seq
        self.hook = Hook(name, step, waits_in, seq)

    def run(self, op: str, fn: Callable, spec: _Signature, args: tuple, kwargs: dict, frame: Any) -> Any:
        """Call ``fn`` as the communication ``op``, recorded as this rank's current call while it runs."""
        try:
            call = self._record(op, spec, args, kwargs, frame)
        except Exception:  # the bookkeeping must never break the user's collective: run it unrecorded
            return fn(*args, **kwargs)
        self.call = call
        try:
            result = fn(*args, **kwargs)
        finally:
            # A Work kept by the caller must not keep the caller's frame (and its tensors) alive.
            self.call, call.frame = None, None
        if result is not None and (op in _ASYNC_ALWAYS or spec.get("async_op", args, kwargs)):
            return _tracked_works(result, call)
        return result

    def _record(self, op: str, spec: _Signature, args: tuple, kwargs: dict, frame: Any) -> Call:
        raw_group = spec.get("group", args, kwargs)
        if op == "batch_isend_irecv":
            ops = spec.get("p2p_op_list", args, kwargs)
            raw_group = ops[0].group if ops else None
        group = self._group(raw_group)
        if op in POINT_TO_POINT:
            return Call(op, group, None, _p2p_pairs(op, spec, args, kwargs, group), frame)
        seq = self.counters[group.name] = self.counters.get(group.name, 0) + 1
        self.last_ops[group.name] = op
        return Call(op, group, seq, (), frame)

    def snapshot(self) -> dict[str, Any]:
        """Where this rank is, as plain data (read from the monitor thread; one read of each field)."""
        call, hook, now = self.call, self.hook, time.monotonic()
        state: dict[str, Any] = {"hook": hook.name, "step": hook.step, "counters": dict(self.counters)}
        state["last_ops"] = dict(self.last_ops)
        state["name"] = call.op if call is not None else hook.waits_in
        if call is not None:
            site = user_site(call.frame)
            state.update(
                kind="p2p" if call.p2p else "collective", op=call.label(), group=call.group.name,
                group_label=call.group.label, members=call.group.ranks, seq=call.seq,
                p2p=[list(pair) for pair in call.p2p], site=site, waiting=now - call.since,
            )  # fmt: skip
        elif hook.waits_in is not None:
            state.update(
                kind="untracked", op=hook.waits_in, group=f"untracked:{hook.waits_in}", group_label="world",
                members=None, seq=hook.seq, p2p=[], site=None, waiting=now - hook.since,
            )  # fmt: skip
        else:
            state.update(kind="computing", op=None, seq=None, p2p=[], site=None, waiting=now - hook.since)
        return state

    def _group(self, group: Any) -> _Group:
        # Keyed by id: holding the group object itself would keep a destroyed process group alive.
        info = self._groups.get(id(group))
        if info is None:
            info = self._groups[id(group)] = _describe_group(group)
        return info


def _describe_group(group: Any) -> _Group:
    if group is None or group is dist.GroupMember.WORLD:
        return _Group("world", None, "world")
    ranks = tuple(dist.get_process_group_ranks(group))
    # group_name is the same on every member (torch derives it from the creation order), the ranks
    # alone are not: two groups may hold the same ranks.
    label = f"ranks {','.join(map(str, ranks))}" if len(ranks) <= 8 else f"{len(ranks)} ranks from {ranks[0]}"
    return _Group(str(group.group_name), ranks, label)


def _peer(peer: int) -> str:
    return "any rank" if peer < 0 else f"rank {peer}"


def _p2p_pairs(op: str, spec: _Signature, args: tuple, kwargs: dict, group: _Group) -> tuple:
    """("recv" | "send", global peer rank) for each transfer of a point-to-point call."""
    if op == "batch_isend_irecv":
        ops = spec.get("p2p_op_list", args, kwargs) or []
        return tuple(("recv" if o.op.__name__ == "irecv" else "send", int(o.peer)) for o in ops)
    receives = op in _RECEIVES
    peer = spec.get("src" if receives else "dst", args, kwargs)
    if peer is None:
        local = spec.get("group_src" if receives else "group_dst", args, kwargs)
        peer = -1 if local is None else (local if group.ranks is None else group.ranks[local])
    return (("recv" if receives else "send", int(peer)),)


class _Signature:
    """Where a torch.distributed function takes ``group``, ``async_op``, ``src``...: by name or position."""

    def __init__(self, fn: Callable) -> None:
        params = list(inspect.signature(fn).parameters.values())
        self.index = {p.name: i for i, p in enumerate(params)}
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def get(self, name: str, args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self.index.get(name)
        if i is not None and i < len(args):
            return args[i]
        return self.defaults.get(name)


class TrackedWork:
    """A ``dist.Work`` whose ``wait()`` is recorded as the communication it waits for.

    The pipeline schedules block in ``work.wait()`` on the works of ``isend``/``irecv``, not in the
    calls themselves; everything but ``wait`` is the wrapped work's own.

    Example::

        work = dist.irecv(buffer, src=0)   # a TrackedWork while tracking is installed
        work.wait()                        # recorded as "recv from rank 0" while it blocks
    """

    __slots__ = ("_call", "_work")

    def __init__(self, work: Any, call: Call) -> None:
        self._work, self._call = work, call

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        activity = _ACTIVE
        if activity is None or activity.call is not None:
            return self._work.wait(*args, **kwargs)
        activity.call = self._call.waited(sys._getframe(1))
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            activity.call = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _tracked_works(result: Any, call: Call) -> Any:
    if isinstance(result, list):
        return [TrackedWork(w, call) if w is not None else None for w in result]
    return TrackedWork(result, call)


# ---------------------------------------------------------------------------- install / uninstall
_ACTIVE: RankActivity | None = None
_ORIGINALS: dict[str, Callable] = {}
_MODULES = (dist, c10d)


def _wrap(name: str, original: Callable) -> Callable:
    spec = _Signature(original)

    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        activity = _ACTIVE
        # Nested calls (all_gather_object -> all_gather) belong to the outer one; a call from another
        # thread while one is recorded passes through too.
        if activity is None or activity.call is not None:
            return original(*args, **kwargs)
        return activity.run(name, original, spec, args, kwargs, sys._getframe(1))

    tracked._lp_watchdog_original = original  # type: ignore[attr-defined]
    return tracked


def install_tracking(activity: RankActivity) -> None:
    """Route the ``torch.distributed`` communication functions through ``activity`` until uninstalled.

    Called by a running watchdog (never at import). A second install points the wrappers at the newer
    activity (the older one's run ended without its teardown).

    Example::

        install_tracking(activity)
        dist.barrier()                 # activity.call says "barrier" while it blocks
        uninstall_tracking(activity)
    """
    global _ACTIVE
    _ACTIVE = activity
    if _ORIGINALS:
        return
    for name in COLLECTIVES + POINT_TO_POINT:
        original = getattr(c10d, name, None)
        if original is None or not callable(original):
            continue
        _ORIGINALS[name] = original
        wrapper = _wrap(name, original)
        for module in _MODULES:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapper)


def uninstall_tracking(activity: RankActivity | None = None) -> None:
    """Restore the original functions (only those still ours: a later patch by someone else stays).

    Example::

        uninstall_tracking(activity)   # a no-op unless ``activity`` is the installed one
    """
    global _ACTIVE
    if activity is not None and activity is not _ACTIVE:
        return
    _ACTIVE = None
    for name, original in _ORIGINALS.items():
        for module in _MODULES:
            if getattr(getattr(module, name, None), "_lp_watchdog_original", None) is original:
                setattr(module, name, original)
    _ORIGINALS.clear()
