"""Benchmark Rank0Checkpoint's file writing against Lightning's ModelCheckpoint path, in the same run.

Measures, on a state of ``--size-mb`` MB (default ~250 MB of float32 tensors plus SGD-momentum-like
optimizer state in the same dict):

* stall per save: the time the training loop is blocked. ModelCheckpoint writes through
  ``TorchCheckpointIO.save_checkpoint`` (serialise into memory, then move a ``$TMPDIR`` file);
  Rank0Checkpoint sync streams into a same-directory temp file; async blocks only for the snapshot;
* peak extra memory per save (VmHWM after resetting it through ``/proc/self/clear_refs``);
* the kill test: a child process saves in a loop and is SIGKILLed at random instants; after each
  kill, count checkpoint files present, loadable/verifying, and orphaned temp files (in the
  checkpoint directory and in ``$TMPDIR``), with ``$TMPDIR`` on ``/dev/shm`` (another filesystem).

Writes experiments/results/checkpoint_bench.csv, checkpoint_kill.csv and checkpoint_bench.png.

    python experiments/bench_checkpoint.py            # a few minutes
    python experiments/bench_checkpoint.py --size-mb 50 --kills 6 --repeats 2   # quick
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_parallel.io import atomic
from lightning_parallel.io.async_writer import AsyncWriter, snapshot

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def make_state(size_mb: int) -> dict:
    n = size_mb * (1 << 20) // 4 // 2 // 16
    params = {f"layer{i}.weight": torch.randn(n) for i in range(16)}
    return {"state_dict": params, "optimizer_states": [{k: torch.zeros_like(v) for k, v in params.items()}]}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _measure(fn) -> tuple[float, float]:
    """(seconds, peak extra MiB) of fn()."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        resettable = True
    except OSError:
        resettable = False
    base = _rss_kb("VmRSS:")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    peak = _rss_kb("VmHWM:") if resettable else float("nan")
    return dt, (peak - base) / 1024


def bench_stalls(state: dict, directory: str, repeats: int) -> list[dict]:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    lightning_io = TorchCheckpointIO()
    writer = AsyncWriter()

    def async_save(path: str) -> None:
        state_copy = snapshot(state)
        writer.submit(lambda: atomic.save_checkpoint_file(state_copy, path, {"step": 0}))

    methods = {
        "ModelCheckpoint (TorchCheckpointIO)": lambda p: lightning_io.save_checkpoint(state, p),
        "Rank0Checkpoint sync": lambda p: atomic.save_checkpoint_file(state, p, {"step": 0}),
        "Rank0Checkpoint async (stall)": async_save,
    }
    rows = []
    for name, save in methods.items():
        for r in range(repeats):
            path = os.path.join(directory, f"bench-{r}.ckpt")
            writer.wait()
            dt, extra = _measure(lambda save=save, path=path: save(path))
            total = dt
            if "async" in name:
                t0 = time.perf_counter()
                writer.wait()
                total = dt + time.perf_counter() - t0
            rows.append({"method": name, "repeat": r, "stall_s": dt, "total_s": total, "extra_mib": extra})
            print(f"{name:40s} stall {dt:6.3f}s total {total:6.3f}s peak extra {extra:8.1f} MiB", flush=True)
    return rows


_CHILD = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[4])
from lightning_parallel.io import atomic
method, d, size_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = {"w": torch.randn(size_mb * (1 << 20) // 4)}
if method == "lightning":
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    io = TorchCheckpointIO()
    save = lambda p, step: io.save_checkpoint({**state, "step": step}, p)
else:
    save = lambda p, step: atomic.save_checkpoint_file({**state, "step": step}, p, {"step": step})
print("ready", flush=True)
step = 0
while True:
    step += 1
    save(os.path.join(d, "last.ckpt"), step)
    save(os.path.join(d, f"step={step}.ckpt"), step)
    old = os.path.join(d, f"step={step - 1}.ckpt")
    if os.path.exists(old):
        os.remove(old)
"""


def kill_test(method: str, kills: int, size_mb: int, tmpdir: str, seed: int) -> dict:
    rng = random.Random(seed)
    directory = tempfile.mkdtemp(prefix=f"kill-{method}-")
    tmpdir = tempfile.mkdtemp(prefix="kill-tmp-", dir=tmpdir)  # only the child's temp files land here
    env = {**os.environ, "TMPDIR": tmpdir, "OMP_NUM_THREADS": "1"}
    repo = os.path.join(os.path.dirname(__file__), "..")
    present = loadable = bad = 0
    tmp_before = set(os.listdir(tmpdir))
    for _ in range(kills):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, method, directory, str(size_mb), repo],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        proc.stdout.readline()
        time.sleep(rng.uniform(0.2, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for name in os.listdir(directory):
            if not name.endswith(".ckpt"):
                continue
            present += 1
            try:
                torch.load(os.path.join(directory, name), weights_only=False)
                loadable += 1
            except Exception:
                bad += 1
        if method == "rank0":
            atomic.remove_orphans(directory)  # what Rank0Checkpoint.setup does at the next start
    orphans_dir = [n for n in os.listdir(directory) if not n.endswith(".ckpt")]
    orphans_tmp = [n for n in set(os.listdir(tmpdir)) - tmp_before]
    orphan_bytes = sum(os.path.getsize(os.path.join(directory, n)) for n in orphans_dir)
    orphan_bytes += sum(
        os.path.getsize(os.path.join(tmpdir, n))
        for n in orphans_tmp
        if os.path.isfile(os.path.join(tmpdir, n))
    )
    for n in orphans_tmp:
        p = os.path.join(tmpdir, n)
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(tmpdir, ignore_errors=True)
    row = {
        "method": method,
        "tmpdir": tmpdir,
        "kills": kills,
        "files_present": present,
        "files_loadable": loadable,
        "files_unloadable": bad,
        "orphans": len(orphans_dir) + len(orphans_tmp),
        "orphan_mib": orphan_bytes / (1 << 20),
    }
    print(row, flush=True)
    return row


def plot(rows: list[dict], size_mb: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["method"] for r in rows))
    stall = [
        sum(r["stall_s"] for r in rows if r["method"] == n) / max(1, sum(r["method"] == n for r in rows))
        for n in names
    ]
    extra = [max(r["extra_mib"] for r in rows if r["method"] == n) for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    short = [n.replace(" (TorchCheckpointIO)", "").replace("Rank0Checkpoint", "Rank0") for n in names]
    axes[0].bar(short, stall)
    axes[0].set_ylabel("stall per save (s)")
    axes[1].bar(short, extra)
    axes[1].axhline(size_mb, color="gray", ls="--", label="checkpoint size")
    axes[1].set_ylabel("peak extra memory (MiB)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"Checkpoint save of a {size_mb} MB state (same run)")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "checkpoint_bench.png"), dpi=100)


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=250, help="checkpoint size in MB (default 250)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per method (default 3)")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per method and TMPDIR (default 20)")
    parser.add_argument(
        "--kill-size-mb", type=int, default=50, help="state size in the kill test (default 50)"
    )
    parser.add_argument("--dir", default=None, help="where to write the benchmark checkpoints")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(RESULTS, exist_ok=True)
    directory = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.getcwd())
    os.makedirs(directory, exist_ok=True)
    state = make_state(args.size_mb)
    rows = bench_stalls(state, directory, args.repeats)
    shutil.rmtree(directory, ignore_errors=True)
    _write_csv(os.path.join(RESULTS, "checkpoint_bench.csv"), rows)
    plot(rows, args.size_mb)
    del state
    kills = []
    tmpdirs = [tempfile.gettempdir()] + (["/dev/shm"] if os.path.isdir("/dev/shm") else [])
    for tmpdir in tmpdirs:
        for i, method in enumerate(("lightning", "rank0")):
            kills.append(kill_test(method, args.kills, args.kill_size_mb, tmpdir, seed=i))
    _write_csv(os.path.join(RESULTS, "checkpoint_kill.csv"), kills)


if __name__ == "__main__":
    main()
