"""Opt-in pytest plugin: each test's wall and CPU seconds, the CPU of the whole machine (its ranks too).

    PYTHONPATH=tests pytest -p cpu_per_test   # writes cpu_per_test.csv (CPU_PER_TEST_CSV: another file)

Spawned ranks are not pytest's children once a forkserver starts them, so their CPU is read where it
is counted for every process: the busy time of ``/proc/stat``, before and after each test. Run it on a
quiet machine and in one process (not under ``make test``'s workers, whose tests overlap): what
docs/development.md says of where the suite's CPU goes was measured this way.
"""

from __future__ import annotations

import csv
import os
import time

_rows: list[tuple[str, float, float]] = []
_started: dict[str, tuple[float, float]] = {}


def _busy_seconds() -> float:
    """The machine's CPU seconds spent outside idle and I/O wait since boot (every core)."""
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
