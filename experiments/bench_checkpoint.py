"""Rank0Checkpoint's file writing against Lightning's ModelCheckpoint path, in the same run.

On a state of ``--size-mb`` MB (default ~250 MB of float32 tensors plus SGD-momentum-like optimizer
state in the same dict):

* **stall per save**, the time the training loop is blocked, and the time until the file is complete.
  ModelCheckpoint writes through ``TorchCheckpointIO.save_checkpoint`` (serialise into memory, then
  move a ``$TMPDIR`` file); Rank0Checkpoint sync streams into a same-directory temp file; async blocks
  only for an in-memory snapshot. The three save methods run interleaved (the first one rotating),
  ``--repeats`` times each; the stall ratio to ModelCheckpoint is taken per repeat;
* **peak extra memory per save** (VmHWM after resetting it through ``/proc/self/clear_refs``);
* **the kill test** (no timing): a child process saves in a loop and is SIGKILLed at a random instant,
  ``--kills`` times per writer and ``$TMPDIR``; after each kill, count the checkpoint files present,
  loadable and not, and the orphaned temp files (in the checkpoint directory and in ``$TMPDIR``), with
  ``$TMPDIR`` on ``/tmp`` and on ``/dev/shm`` (another filesystem).

Writes ``checkpoint_bench.csv`` (one row per save), ``checkpoint_kill.csv`` and ``checkpoint_bench.png``.

    python experiments/bench_checkpoint.py            # a few minutes
    python experiments/bench_checkpoint.py --quick    # small state, few kills
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import _tables as t
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_parallel.io import atomic
from lightning_parallel.io.async_writer import AsyncWriter, SnapshotBuffers

ASYNC_STALL_GOAL = 0.10  # an async save stalls training at most a tenth of ModelCheckpoint's save (issue 14)

BASELINE = "ModelCheckpoint (TorchCheckpointIO)"


def make_state(size_mb: int) -> dict:
    n = size_mb * (1 << 20) // 4 // 2 // 16
    params = {f"layer{i}.weight": torch.randn(n) for i in range(16)}
    return {"state_dict": params, "optimizer_states": [{k: torch.zeros_like(v) for k, v in params.items()}]}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _release_free_memory() -> None:
    """Give the memory the allocator keeps after frees back to the OS (glibc's ``malloc_trim``).

    Without it a save reuses what the previous save freed and its peak RSS hardly moves: with the
    methods interleaved, a save's extra memory would depend on which one ran before it.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: no such call to make
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_save(save: Callable[[], None]) -> tuple[float, float]:
    """(seconds, peak extra MiB) of ``save()``: VmHWM is reset first, so its peak is this save's."""
    gc.collect()
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        resettable = True
    except OSError:
        resettable = False
    base = _status_kb("VmRSS:")
    t0 = time.perf_counter()
    save()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM:") if resettable else float("nan")
    return dt, (peak - base) / 1024


def save_methods(state: dict, directory: str, writer: AsyncWriter) -> dict[str, Callable[[], dict]]:
    """The three ways to save ``state``; each returns its stall, its time to a complete file, its memory."""
    lightning_io = TorchCheckpointIO()
    path = os.path.join(directory, "bench.ckpt")

    def timed(save: Callable[[], None], wait: bool = False) -> dict[str, float]:
        stall, extra = measure_save(save)
        t0 = time.perf_counter()
        if wait:
            writer.wait()
        return {"stall_s": stall, "total_s": stall + time.perf_counter() - t0, "extra_mib": extra}

    buffers = SnapshotBuffers()  # what Rank0Checkpoint(async_save=True) keeps: allocated once, reused

    def async_save() -> None:
        copy = buffers.snapshot(state)
        writer.submit(lambda: atomic.save_checkpoint_file(copy, path, {"step": 0}))

    return {
        BASELINE: lambda: timed(lambda: lightning_io.save_checkpoint(state, path)),
        "Rank0Checkpoint sync": lambda: timed(lambda: atomic.save_checkpoint_file(state, path, {"step": 0})),
        "Rank0Checkpoint async (stall)": lambda: timed(async_save, wait=True),
    }


def bench_stalls(size_mb: int, repeats: int, directory: str) -> list[dict[str, Any]]:
    """Every save method ``repeats`` times, interleaved; one row per save with its stall ratio."""
    state, writer = make_state(size_mb), AsyncWriter()
    # warmup: the first save of a process pays one-off costs (allocator growth, pickler set-up).
    methods = save_methods(state, directory, writer)
    samples = h.interleave(methods, repeats, before_each=writer.wait, warmup=True)
    base = {s["repeat"]: s["stall_s"] for s in samples if s["variant"] == BASELINE}
    rows = []
    for s in samples:
        row = dict(method=s["variant"], repeat=s["repeat"], position=s["position"])
        row |= {k: round(s[k], 4) for k in ("stall_s", "total_s", "extra_mib")}
        row["stall_vs_model_checkpoint"] = round(s["stall_s"] / base[s["repeat"]], 4)
        row["goal"] = ASYNC_STALL_GOAL if s["variant"] == "Rank0Checkpoint async (stall)" else ""
        rows.append(row)
        print(
            f"{row['method']:36s} stall {row['stall_s']:6.3f}s total {row['total_s']:6.3f}s "
            f"peak extra {row['extra_mib']:8.1f} MiB",
            flush=True,
        )
    names = list(dict.fromkeys(r["method"] for r in rows))  # the methods in their declared order
    return sorted(rows, key=lambda r: (names.index(r["method"]), r["repeat"]))


# ----------------------------------------------------------------------------------- kill test


def save_loop(method: str, directory: str, size_mb: int, tmpdir: str, ready: Any) -> None:
    """The child of the kill test: save ``last.ckpt`` and ``step=N.ckpt`` in a loop until killed."""
    os.environ["TMPDIR"] = tmpdir
    tempfile.tempdir = None  # forget the parent's cached temp dir: the writers must use $TMPDIR
    torch.set_num_threads(1)
    state = {"w": torch.randn(size_mb * (1 << 20) // 4)}
    if method == "lightning":
        io = TorchCheckpointIO()

        def save(p: str, step: int) -> None:
            io.save_checkpoint({**state, "step": step}, p)
    else:

        def save(p: str, step: int) -> None:
            atomic.save_checkpoint_file({**state, "step": step}, p, {"step": step})

    ready.set()
    step = 0
    while True:
        step += 1
        save(os.path.join(directory, "last.ckpt"), step)
        save(os.path.join(directory, f"step={step}.ckpt"), step)
        old = os.path.join(directory, f"step={step - 1}.ckpt")
        if os.path.exists(old):
            os.remove(old)


def _count_files(directory: str) -> tuple[int, int, int]:
    """Checkpoint files present, loadable and unloadable in ``directory``."""
    present = loadable = 0
    for name in os.listdir(directory):
        if name.endswith(".ckpt"):
            present += 1
            try:
                torch.load(os.path.join(directory, name), weights_only=False)
                loadable += 1
            except Exception:  # a torn file fails in many ways (EOF, zip errors, unpickling)
                pass
    return present, loadable, present - loadable


def _orphans(directory: str, tmpdir: str) -> tuple[int, float]:
    """Temp files left behind (in the checkpoint directory and in TMPDIR) and their MiB."""
    paths = [os.path.join(directory, n) for n in os.listdir(directory) if not n.endswith(".ckpt")]
    paths += [os.path.join(tmpdir, n) for n in os.listdir(tmpdir)]
    size = sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    return len(paths), size / (1 << 20)


def _clear(directory: str, keep: str | None = None) -> None:
    for name in os.listdir(directory):
        if keep is None or not name.endswith(keep):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


def kill_test(method: str, kills: int, size_mb: int, tmp_root: str, seed: int) -> dict[str, Any]:
    """SIGKILL a saving child ``kills`` times at random instants; count what it leaves behind."""
    rng = random.Random(seed)
    directory = tempfile.mkdtemp(prefix=f"kill-{method}-")
    tmpdir = tempfile.mkdtemp(prefix="kill-tmp-", dir=tmp_root)  # only the child's temp files land here
    # fork, not spawn: the child is saving within milliseconds, so the random kill instants fall in
    # the saves rather than in a fresh interpreter's imports.
    context = multiprocessing.get_context("fork")
    counts, orphans, orphan_mib = [0, 0, 0], 0, 0.0
    for _ in range(kills):
        ready = context.Event()
        child = context.Process(target=save_loop, args=(method, directory, size_mb, tmpdir, ready))
        child.start()
        if not ready.wait(timeout=120):
            child.kill()
            raise RuntimeError(f"the {method} saving child did not start within 120 s")
        time.sleep(rng.uniform(0.2, 2.0))
        child.kill()
        child.join()
        counts = [a + b for a, b in zip(counts, _count_files(directory))]
        # What this kill left behind, before any clean-up (Rank0Checkpoint's next start removes a
        # named temp file; an unnamed O_TMPFILE one never appears).
        left, left_mib = _orphans(directory, tmpdir)
        orphans, orphan_mib = orphans + left, orphan_mib + left_mib
        if method == "rank0":
            atomic.remove_orphans(directory)  # what Rank0Checkpoint.setup does at the next start
        _clear(directory, keep=".ckpt")  # counted once: the next kill's leftovers are its own
        _clear(tmpdir)
    temp_file = atomic.temp_file_method(directory) if method == "rank0" else "named, in TMPDIR"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(tmpdir, ignore_errors=True)
    row = dict(method=method, tmpdir=tmpdir, kills=kills, files_present=counts[0], files_loadable=counts[1])
    row["temp_file"] = temp_file
    row |= dict(files_unloadable=counts[2], orphans=orphans, orphan_mib=round(orphan_mib, 3))
    print(row, flush=True)
    return row


def plot(path: Path, rows: list[dict[str, Any]], size_mb: int) -> None:
    names = list(dict.fromkeys(r["method"] for r in rows))
    summary = [
        h.spread(r["stall_s"] for r in rows if r["method"] == n).cells("stall_s")
        | h.spread(r["extra_mib"] for r in rows if r["method"] == n).cells("extra_mib")
        for n in names
    ]
    fig, (left, right) = h.figure(2, size=(11, 4))
    short = [n.replace(" (TorchCheckpointIO)", "").replace("Rank0Checkpoint", "Rank0") for n in names]
    h.errorbars(left, short, summary, "stall_s", fmt="o", color="tab:blue")
    left.set_ylabel("stall per save (s), median and min-max")
    left.set_ylim(bottom=0)
    h.errorbars(right, short, summary, "extra_mib", fmt="o", color="tab:orange")
    right.axhline(size_mb, color="gray", ls="--", label="checkpoint size")
    right.set_ylabel("peak extra memory (MiB), median and min-max")
    right.set_ylim(bottom=-10)
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=15)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"Checkpoint save of a {size_mb} MB state, {summary[0]['stall_s']:.2f} s median stall for "
        f"ModelCheckpoint; methods interleaved in one run",
        fontsize=9,
    )
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def checkpoint_bench(rows: t.Rows) -> str:
    body = []
    for method, saves in t.groups(rows, "method").items():
        ratio = h.spread(float(r["stall_vs_model_checkpoint"]) for r in saves)
        baseline = ratio.lo == ratio.hi == 1.0
        goal = saves[0].get("goal") or None
        verdict = h.verdict(
            ratio.lo,
            ratio.hi,
            None if goal is None else float(goal),
            higher_is_better=False,
            words=("shorter", "longer"),
        )

        body.append(
            [method, len(saves)]
            + [t.timed_rows(saves, k, 2) for k in ("stall_s", "total_s")]
            + [t.timed_rows(saves, "extra_mib", 1)]
            + ["-" if baseline else t.timed_rows(saves, "stall_vs_model_checkpoint", 2, verdict)]
        )
    header = ["method", "saves", "training stall s", "save done s", "extra memory MiB"]
    goals = [r["goal"] for r in rows if r.get("goal")]
    ratio = f"stall vs ModelCheckpoint (async goal <= {goals[0]})" if goals else "stall vs ModelCheckpoint"
    return t.table([*header, ratio], body)


def checkpoint_kill(rows: t.Rows) -> str:
    body = [
        [
            r["method"],
            r.get("temp_file", ""),
            os.path.dirname(r["tmpdir"]),
            r["kills"],
            r["files_present"],
            r["files_loadable"],
            r["files_unloadable"],
            r["orphans"],
            t.fixed(r["orphan_mib"], 1),
        ]
        for r in rows
    ]
    header = ["writer", "temp file", "TMPDIR on", "kills", "files present", "loadable", "unloadable"]
    return t.table([*header, "temp files left by the kills", "their MiB"], body) + (
        "\n\nLeft behind counts each kill's leftovers before any clean-up (Rank0Checkpoint removes a named "
        "temp file at its next start; an unnamed O_TMPFILE one never appears)."
    )


RESULTS = t.Results(
    "checkpoint",
    t.Section(
        "Checkpoints: Rank0Checkpoint against ModelCheckpoint (stall, memory, SIGKILL)",
        t.Table(
            checkpoint_bench, ("stall_s", "total_s", "extra_mib", "stall_vs_model_checkpoint"), timed=True
        ),
        t.Table(
            checkpoint_kill,
            ("kills", "files_present", "files_loadable", "files_unloadable", "orphans", "orphan_mib"),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--size-mb", type=int, default=250, help="checkpoint size in MB (default 250)")
    p.add_argument("--kills", type=int, default=16, help="SIGKILLs per writer and TMPDIR (default 16)")
    p.add_argument("--kill-size-mb", type=int, default=50, help="state size in the kill test (default 50)")
    p.add_argument("--dir", default=None, help="where to write the benchmark checkpoints (default: here)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.kills, args.kill_size_mb, args.repeats = 4, 1, 2, 1
    h.quiet()
    h.record_machine("checkpoint", args.out_dir)
    directory = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir or os.getcwd())
    try:
        rows = bench_stalls(args.size_mb, args.repeats, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    h.write_csv(args.out_dir / "checkpoint_bench.csv", rows)
    plot(args.out_dir / "checkpoint_bench.png", rows, args.size_mb)
    gc.collect()
    tmp_roots = [tempfile.gettempdir()] + (["/dev/shm"] if os.path.isdir("/dev/shm") else [])
    kills = [
        kill_test(method, args.kills, args.kill_size_mb, root, seed=i)
        for root in tmp_roots
        for i, method in enumerate(("lightning", "rank0"))
    ]
    h.write_csv(args.out_dir / "checkpoint_kill.csv", kills)


if __name__ == "__main__":
    main()
