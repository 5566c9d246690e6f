"""From every rank's published snapshot to a verdict: is this a hang, which rank is where, and why.

Pure functions over plain data (the dicts :meth:`RankActivity.snapshot` makes, plus ``rank``, ``beat``,
``stopped``, ``where``, ``stack`` added by the monitor), so each diagnosis is tested without processes.

A hang: a rank has waited in a communication longer than ``timeout`` while some rank it waits for is not
in the matching one (another collective or sequence number, not sending to it, or computing). A step that
computes longer than ``timeout`` on every rank is slow, not hung; so is a collective that every member is
in. A rank whose heartbeat stopped for ``gone_after`` seconds is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lightning_parallel._table import format_table

__all__ = ["Diagnosis", "diagnose", "format_report", "stuck_ranks"]

View = dict[str, Any]
WAITING_KINDS = ("collective", "p2p", "untracked")


@dataclass(frozen=True)
class Diagnosis:
    """The one-line verdict, the ranks it is about, and the ranks that are gone.

    Example::

        Diagnosis("rank 1 is gone: no heartbeat for 12 s ...", gone=(1,))
    """

    text: str
    stuck: tuple[int, ...] = ()
    gone: tuple[int, ...] = field(default=())


def diagnose(
    views: dict[int, View], silent: dict[int, float], world: int, timeout: float, gone_after: float
) -> Diagnosis | None:
    """The verdict on the ranks' snapshots, or None while nothing is hung and nobody is gone.

    Args:
        views: each rank's latest snapshot, by rank (a rank that never published is absent).
        silent: seconds since each rank's heartbeat last changed, as seen by the judging rank.
        world: number of ranks.
        timeout: seconds a rank may wait in an unmatched communication.
        gone_after: seconds without a heartbeat after which a rank is gone.

    Example::

        verdict = diagnose(views, silent, world=2, timeout=300.0, gone_after=310.0)
        if verdict is not None:
            print(verdict.text)   # "rank 1 called barrier at train.py:42 that no other rank called: ..."
    """
    gone = tuple(r for r in range(world) if silent.get(r, 0.0) > gone_after and not _stopped(views, r))
    if gone:
        return Diagnosis(_gone_text(gone, views, silent), gone=gone)
    stuck = stuck_ranks(views, world, timeout)
    if not stuck:
        return _uneven_counts(views, world, timeout)
    # The explanation may come from a rank that has waited less than the timeout: the rank that
    # called an extra barrier can be the second to block, after its peer blocked in backward.
    involved = [v for v in views.values() if _waiting(v) and _unmatched_partners(v, views, world)]
    return Diagnosis(_explain(involved, views, world), stuck=tuple(stuck))


def stuck_ranks(views: dict[int, View], world: int, timeout: float) -> list[int]:
    """Ranks waiting longer than ``timeout`` in a communication that some partner is not in.

    Example::

        stuck_ranks(views, world=2, timeout=300.0)   # [1]: rank 1 waits in a barrier rank 0 skipped
    """
    return sorted(
        v["rank"]
        for v in views.values()
        if _waiting(v) and v["waiting"] > timeout and _unmatched_partners(v, views, world)
    )


def _uneven_counts(views: dict[int, View], world: int, timeout: float) -> Diagnosis | None:
    """Every rank stalled past the timeout, and one issued a collective the others did not.

    On gloo a rank blocks inside such a collective and is caught above. NCCL runs it on the GPU and
    returns: the ranks then block at their next synchronization (``loss.item()``), all "computing".
    Equal counts mean a step that is only slow.
    """
    if len(views) < world or any(v.get("stopped") or v["waiting"] <= timeout for v in views.values()):
        return None
    for group in sorted({g for v in views.values() for g in v.get("counters", {})}):
        counts = {r: v["counters"][group] for r, v in views.items() if group in v.get("counters", {})}
        ahead, behind = max(counts, key=counts.get), min(counts, key=counts.get)
        if counts[ahead] != counts[behind]:
            op = views[ahead].get("last_ops", {}).get(group, "a collective")
            where = "world" if group == "world" else f"group {group}"
            text = (
                f"no rank has moved for {min(v['waiting'] for v in views.values()):.0f} s and rank {ahead} "
                f"issued {op} #{counts[ahead]} on {where} that rank {behind} did not (it is at "
                f"#{counts[behind]}): a collective only some ranks called; the GPU runs it asynchronously, "
                f"so the ranks block later, at their next synchronization"
            )
            return Diagnosis(text, stuck=tuple(sorted(views)))
    return None


def _waiting(v: View) -> bool:
    return v["kind"] in WAITING_KINDS and not v.get("stopped")


def _stopped(views: dict[int, View], rank: int) -> bool:
    return bool(views.get(rank, {}).get("stopped"))


def _partners(v: View, world: int) -> list[int]:
    if v["kind"] == "p2p":
        return sorted({peer for _, peer in v["p2p"] if peer >= 0})
    return [r for r in (v["members"] or range(world)) if r != v["rank"]]


def _matches(v: View, other: View | None) -> bool:
    """Whether ``other`` is in the communication that completes ``v``'s."""
    if other is None or other.get("stopped"):
        return False
    if v["kind"] == "p2p":
        opposite = {"recv": "send", "send": "recv"}
        return other["kind"] == "p2p" and any(
            [opposite[d], v["rank"]] in [list(x) for x in other["p2p"]] for d, _ in v["p2p"]
        )
    same = ("kind", "group", "seq", "name")
    return all(other.get(key) == v.get(key) for key in same)


def _unmatched_partners(v: View, views: dict[int, View], world: int) -> list[int]:
    return [r for r in _partners(v, world) if not _matches(v, views.get(r))]


def _explain(involved: list[View], views: dict[int, View], world: int) -> str:
    """One line naming the rank to look at first: the most specific cause among the waiting ranks."""
    candidates = []
    for w in involved:
        others = [views.get(r) or {"rank": r, "kind": "absent"} for r in _unmatched_partners(w, views, world)]
        partners = len(_partners(w, world))
        for priority, explain in enumerate(_EXPLANATIONS):
            text = explain(w, others, partners)
            if text is not None:
                candidates.append((priority, -w["waiting"], text))
                break
    return min(candidates)[2]


def _left(w: View, others: list[View], partners: int) -> str | None:
    gone = [o for o in others if o.get("stopped") or o["kind"] == "absent"]
    if not gone:
        return None
    o = gone[0]
    what = "has left the run (its fit ended or raised)" if o.get("stopped") else "never reported"
    return (
        f"rank {o['rank']} {what} while rank {w['rank']} waits in {_what(w)} for {w['waiting']:.0f} s: "
        f"the ranks ran different numbers of steps or collectives"
    )


def _not_reached(w: View, others: list[View], partners: int) -> str | None:
    computing = [o for o in others if o["kind"] == "computing"]
    if not computing:
        return None
    o = max(computing, key=lambda v: v["waiting"])
    # Under NCCL a collective returns at once and the rank blocks later on its GPU: "computing".
    nccl = (
        " (under NCCL it may be blocked on its GPU: its stack shows where)"
        if o.get("backend") == "nccl"
        else ""
    )
    return (
        f"rank {o['rank']} has not reached a collective for {o['waiting']:.0f} s: it is in "
        f"{_where(o)}{nccl}, while rank {w['rank']} waits in {_what(w)}"
    )


def _branch(w: View, others: list[View], partners: int) -> str | None:
    if w["kind"] != "collective" or not others:
        return None
    if any(o.get("counters", {}).get(w["group"], 0) >= w["seq"] for o in others):
        return None  # somebody did reach this sequence number: not a skipped collective
    missing = ", ".join(str(o["rank"]) for o in others)
    ranks = f"rank {missing}" if len(others) == 1 else f"ranks {missing}"
    who = "no other rank called" if len(others) == partners else f"{ranks} did not call"
    meanwhile = "; ".join(f"rank {o['rank']} {_doing(o)}" for o in others)
    return (
        f"rank {w['rank']} called {w['name']} at {w['site'] or '?'} that {who}: a collective inside a "
        f"rank-dependent branch ({meanwhile})"
    )


def _mismatch(w: View, others: list[View], partners: int) -> str | None:
    same = [o for o in others if o["kind"] == "collective" and o["group"] == w["group"]]
    if w["kind"] != "collective" or not same:
        return None
    calls = "; ".join(f"rank {v['rank']} {v['name']} #{v['seq']} at {v['site'] or '?'}" for v in [w, *same])
    return f"the ranks are in different collectives on {w['group_label']}: {calls}"


def _deadlock(w: View, others: list[View], partners: int) -> str | None:
    both = [o for o in others if o["kind"] == "p2p" and w["kind"] == "p2p"]
    if not both:
        return None
    o = both[0]
    return (
        f"ranks {w['rank']} and {o['rank']} wait for each other: rank {w['rank']} in {_what(w)}, "
        f"rank {o['rank']} in {_what(o)}: their sends and receives do not pair up"
    )


def _anything(w: View, others: list[View], partners: int) -> str:
    meanwhile = "; ".join(f"rank {o['rank']} {_doing(o)}" for o in others)
    return f"rank {w['rank']} waits in {_what(w)} for {w['waiting']:.0f} s; {meanwhile}"


_EXPLANATIONS = (_left, _not_reached, _branch, _mismatch, _deadlock, _anything)


def _what(v: View) -> str:
    """``barrier #7 on world at train.py:42`` / ``DDP gradient all-reduce (backward)``."""
    if v["kind"] == "computing":
        return _where(v)
    if v["kind"] == "untracked":
        return f"{v['op']} ({v['hook']}, step {v['step']})"
    seq = f" #{v['seq']} on {v['group_label']}" if v.get("seq") is not None else ""
    site = f" at {v['site']}" if v.get("site") else ""  # None: torch or Lightning called it, not you
    return f"{v['op']}{seq}{site}"


def _doing(v: View) -> str:
    if v["kind"] == "absent":
        return "never reported"
    return f"computes in {_what(v)}" if v["kind"] == "computing" else f"waits in {_what(v)}"


def _where(v: View) -> str:
    """``train.py:57 (training_step, step 3)``; only the hook while no stack was taken yet."""
    step = f", step {v['step']}" if v.get("step") is not None else ""
    return f"{v['where']} ({v['hook']}{step})" if v.get("where") else f"{v['hook']}{step}"


def _gone_text(gone: tuple[int, ...], views: dict[int, View], silent: dict[int, float]) -> str:
    first = gone[0]
    ranks = f"rank {first} is" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))} are"
    last = views.get(first)
    seen = f"; it was last seen in {_what(last)}" if last else ""
    return (
        f"{ranks} gone: no heartbeat for {silent[first]:.0f} s (killed, out of memory, or its Python "
        f"frozen){seen}"
    )


# --------------------------------------------------------------------------------------- the report
def format_report(
    diagnosis: Diagnosis,
    views: dict[int, View],
    silent: dict[int, float],
    world: int,
    timeout: float,
    exit_code: int,
    full_stacks: bool = True,
) -> str:
    """The report: the diagnosis, one table row per rank, every rank's main-thread stack.

    With ``full_stacks=False`` each run of library frames between your frames is one line, except the
    innermost frames, where the rank blocks (the terminal's copy; the file keeps every frame).

    Example::

        print(format_report(verdict, views, silent, world=2, timeout=300.0, exit_code=1))
    """
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    rule = "=" * 100
    lines = [rule, f"HangWatchdog report ({when}, {world} ranks, timeout {timeout:g} s)"]
    lines += [f"diagnosis: {diagnosis.text}", "", _table(diagnosis, views, silent, world), ""]
    lines += ["main-thread Python stacks, innermost call last ('>' marks your code):"]
    lines += _stacks(views, world, full_stacks)
    lines += [f"every rank now exits with code {exit_code}.", rule]
    return "\n".join(lines) + "\n"


def _table(diagnosis: Diagnosis, views: dict[int, View], silent: dict[int, float], world: int) -> str:
    headers = ["rank", "state", "collective", "seq", "group", "call site", "hook", "step", "waiting s"]
    rows = []
    for r in range(world):
        v = views.get(r)
        if v is None:
            rows.append([str(r), "never reported", *["-"] * 7])
            continue
        state = "computing" if v["kind"] == "computing" else "waiting"
        state = "gone" if r in diagnosis.gone else "finished" if v.get("stopped") else state
        state += " (stuck)" if r in diagnosis.stuck else ""
        site = v["site"] if v["kind"] != "computing" else v.get("where")
        seconds = f"{v['waiting']:.1f}" if r not in diagnosis.gone else f"silent {silent.get(r, 0):.0f}"
        seq = "-" if v.get("seq") is None else f"#{v['seq']}"
        group = "-" if v["kind"] == "computing" else v.get("group_label") or "-"
        rows.append(
            [str(r), state, v.get("op") or "-", seq, group, site or "-", v["hook"], _str(v["step"]), seconds]
        )
    return format_table(headers, rows)


def _str(value: Any) -> str:
    return "-" if value is None else str(value)


def _stacks(views: dict[int, View], world: int, full: bool) -> list[str]:
    """Each distinct stack once, headed by the ranks that share it."""
    groups: dict[str, list[int]] = {}
    for r in range(world):
        stack = (views.get(r) or {}).get("stack")
        text = _format_stack(stack, full) if stack else "    (no stack: the rank is gone or was not stalled)"
        groups.setdefault(text, []).append(r)
    lines = []
    for text, ranks in groups.items():
        hosts = {f"pid {views[r].get('pid')} on {views[r].get('host')}" for r in ranks if r in views}
        where = f" ({hosts.pop()})" if len(hosts) == 1 else ""
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} (same stack)"
        lines += [f"{name}{where}:", text]
    return lines


INNERMOST_SHOWN = 3
"""Library frames always shown at the inner end of a compact stack: where the rank blocks."""


def _format_stack(stack: list[list[Any]], full: bool) -> str:
    lines: list[str] = []
    hidden: list[str] = []
    for i, (path, line, name, source, is_user) in enumerate(stack):
        if not (full or is_user or i >= len(stack) - INNERMOST_SHOWN):
            hidden.append(_package(path))
            continue
        if hidden:
            lines.append(f"      ... {len(hidden)} frames in {', '.join(dict.fromkeys(hidden))}")
            hidden = []
        lines.append(f'  {">" if is_user else " "} File "{path}", line {line}, in {name}')
        if source:
            lines.append(f"        {source}")
    return "\n".join(lines)


def _package(path: str) -> str:
    """``lightning`` for ``.../site-packages/lightning/pytorch/trainer.py``; ``python`` for the stdlib."""
    parts = path.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1]
    if "lightning_parallel" in parts:
        return "lightning_parallel"
    return "python" if path.startswith(("/", "<")) else parts[0]
