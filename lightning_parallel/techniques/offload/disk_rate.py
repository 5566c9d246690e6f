"""The disk tier's bandwidth, measured once: what the planner charges the state's streaming at.

Per optimizer step the tier reads its rank's files once and writes them back once (``disk_stream.py``).
:func:`disk_bandwidth` times that on the disk under ``offload_dir``: a small file written, flushed to the
disk (``fsync``) and dropped from the page cache (``posix_fadvise(DONTNEED)``, where the platform has
it) before it is read back, so the figure is the disk's and not the page cache's; the median of a few
repeats after a warm-up, as the host copy is timed (``distributed/link_timing.py: time_copy``). A few
MiB: well under a second on any disk worth offloading to.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from lightning_parallel.techniques.offload.scratch import checked_directory

PROBE_BYTES = 4 << 20
"""The probe file's size: large enough that a disk's latency is not the whole figure, small enough to
take milliseconds."""


def disk_bandwidth(directory: str, nbytes: int = PROBE_BYTES, repeats: int = 3) -> float:
    """Bytes per second of one pass (a write, or a read) over the disk under ``directory``: the median of
    ``repeats`` write + read round trips of ``nbytes`` after a warm-up, halved.

    Raises:
        ValueError: ``directory`` is missing or not writable (the fix named), or ``nbytes`` / ``repeats``
            are not positive.

    Example::

        rate = disk_bandwidth("/local_nvme/offload")     # e.g. 2.1e9 bytes per second
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be positive, got nbytes={nbytes}, repeats={repeats}")
    root = checked_directory(os.fspath(directory))
    data = torch.arange(nbytes, dtype=torch.uint8).numpy().tobytes()
    handle, path = tempfile.mkstemp(prefix="disk-rate-", dir=root)
    try:
        seconds = [_round_trip(handle, data) for _ in range(repeats + 1)][1:]
    finally:
        os.close(handle)
        os.unlink(path)
    return nbytes / max(statistics.median(seconds) / 2, 1e-9)


def _round_trip(fd: int, data: bytes) -> float:
    """Seconds to write ``data`` at the file's start through to the disk and read it back from the disk."""
    start = time.perf_counter()
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):  # (else the read may come from the page cache: a faster figure)
        os.posix_fadvise(fd, 0, len(data), os.POSIX_FADV_DONTNEED)
    done = 0
    while done < len(data):
        got = os.pread(fd, len(data) - done, done)
        if not got:
            break
        done += len(got)
    return time.perf_counter() - start
