"""Opt-in pytest plugin: each test's wall and CPU seconds, its spawned ranks' included.

    PYTHONPATH=tests pytest -p cpu_per_test   # writes cpu_per_test.csv (CPU_PER_TEST_CSV: another file)

Spawned ranks are not pytest's children once a forkserver starts them, so their CPU is read where it
is counted for every process of a group: pytest's own cpuacct cgroup when it runs in one (then other
jobs on a shared machine do not count; ``tests/scripts/cpu_cgroup.sh`` starts a command in a fresh
one), else the busy time of the whole machine (``/proc/stat``: run it on a quiet machine). Run it in
one process (not under ``make test``'s workers, whose tests overlap): what docs/development.md says
of where the suite's CPU goes was measured this way.
"""

from __future__ import annotations

import csv
import os
import time

_rows: list[tuple[str, float, float]] = []
_started: dict[str, tuple[float, float]] = {}


def _own_cgroup_usage() -> str | None:
    """The ``cpuacct.usage`` file of this process's cgroup (cgroup v1), if it is not the root's."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "cpuacct" in controllers.split(",") and path != "/":
            usage = f"/sys/fs/cgroup/cpuacct{path}/cpuacct.usage"
            return usage if os.path.exists(usage) else None
    return None


_USAGE = _own_cgroup_usage()


def _busy_seconds() -> float:
    """CPU seconds since the start: of this process's cgroup (every process in it, every core), else
    the machine's outside idle and I/O wait since boot."""
    if _USAGE is not None:
        with open(_USAGE) as f:
            return int(f.read()) / 1e9
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pytest_runtest_setup(item) -> None:
    _started[item.nodeid] = (time.monotonic(), _busy_seconds())


def pytest_runtest_logfinish(nodeid, location) -> None:
    if nodeid in _started:
        wall, busy = _started.pop(nodeid)
        _rows.append((nodeid, round(time.monotonic() - wall, 2), round(_busy_seconds() - busy, 2)))


def pytest_sessionfinish(session) -> None:
    with open(os.environ.get("CPU_PER_TEST_CSV", "cpu_per_test.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["nodeid", "wall_s", "cpu_s"])
        writer.writerows(_rows)
