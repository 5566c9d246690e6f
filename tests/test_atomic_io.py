"""Atomic, hashed checkpoint files and the background writer (no Lightning, no process group)."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_parallel.io import atomic
from lightning_parallel.io.async_writer import AsyncWriter, snapshot


def _state(n: int = 1000) -> dict:
    return {"model": {"w": torch.randn(n), "b": torch.arange(5)}, "step": 7, "names": ["a", "b"]}


def test_save_is_loadable_and_verifies(tmp_path):
    path = str(tmp_path / "a.ckpt")
    state = _state()
    digest = atomic.save_checkpoint_file(state, path, {"step": 7})
    loaded = torch.load(path, weights_only=False)
    torch.testing.assert_close(loaded["model"]["w"], state["model"]["w"])
    result = atomic.verify_checkpoint(path)
    assert result.ok and result.actual == digest and result.tag["step"] == 7
    assert os.listdir(tmp_path) == ["a.ckpt"]  # no temp file left behind


def test_corruption_and_truncation_are_detected(tmp_path):
    path = str(tmp_path / "a.ckpt")
    atomic.save_checkpoint_file(_state(), path)
    data = bytearray((tmp_path / "a.ckpt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "a.ckpt").write_bytes(bytes(data))
    result = atomic.verify_checkpoint(path)
    assert result.status == "mismatch"
    assert "a.ckpt" in result.describe() and "hash mismatch" in result.describe()
    (tmp_path / "a.ckpt").write_bytes(bytes(data[: len(data) // 2]))
    result = atomic.verify_checkpoint(path)
    assert result.status == "untagged" and "truncated" in result.reason


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = str(tmp_path / "a.ckpt")
    atomic.save_checkpoint_file({"v": torch.ones(3)}, path)
    with pytest.raises(Exception, match=r"could not write checkpoint .*a\.ckpt"):
        atomic.save_checkpoint_file({"v": torch.zeros(3), "bad": lambda: 0}, path)
    assert torch.equal(torch.load(path)["v"], torch.ones(3))
    assert os.listdir(tmp_path) == ["a.ckpt"]


def test_remove_orphans_keeps_live_writers(tmp_path):
    dead = atomic.temp_path_for(str(tmp_path / "x.ckpt")).replace(f"-{os.getpid()}-", "-999999999-")
    live = atomic.temp_path_for(str(tmp_path / "y.ckpt"))
    for p in (dead, live, str(tmp_path / "keep.ckpt")):
        with open(p, "wb"):
            pass
    assert atomic.remove_orphans(str(tmp_path)) == [dead]
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live), "keep.ckpt"])


def test_check_writable_dir_names_the_problem(tmp_path):
    assert atomic.check_writable_dir(str(tmp_path / "new" / "dir")) is None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    problem = atomic.check_writable_dir(str(blocker / "sub"))
    assert (problem is not None and "NotADirectoryError" in problem) or "FileExistsError" in problem


def test_atomic_symlink_and_newest_first(tmp_path):
    a, b = str(tmp_path / "s=1.ckpt"), str(tmp_path / "s=2.ckpt")
    atomic.save_checkpoint_file({"x": 1}, a, {"step": 1})
    atomic.save_checkpoint_file({"x": 2}, b, {"step": 2})
    link = str(tmp_path / "last.ckpt")
    atomic.atomic_symlink(a, link)
    atomic.atomic_symlink(b, link)
    assert torch.load(link)["x"] == 2
    order = [p for p, _ in atomic.newest_first(atomic.list_tagged_checkpoints(str(tmp_path)))]
    assert order[-1] == a


def test_snapshot_copies_tensors_and_containers():
    w = torch.zeros(3)
    best = {"a": torch.tensor(1.0)}
    state = {"w": w, "tied": w, "cb": {"best_k_models": best}, "t": (w, 1)}
    snap = snapshot(state)
    w.add_(1)
    best["b"] = torch.tensor(2.0)
    assert torch.equal(snap["w"], torch.zeros(3)) and snap["w"] is snap["tied"]
    assert list(snap["cb"]["best_k_models"]) == ["a"]
    assert snap["t"][0] is snap["w"]


def test_async_writer_one_in_flight_followups_and_errors():
    writer = AsyncWriter()
    gate = threading.Event()
    events = []
    writer.submit(lambda: (gate.wait(5), events.append("save1")))
    writer.after(lambda: events.append("remove-old"))
    assert writer.in_flight and writer.poll() == (False, None)
    gate.set()
    assert writer.submit(lambda: events.append("save2")) is None  # waited for save1 first
    assert writer.wait() is None
    assert events == ["save1", "remove-old", "save2"]

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    writer.after(lambda: events.append("must not run"))
    error = writer.wait()
    assert isinstance(error, OSError) and "must not run" not in events
    assert writer.wait() is None  # reported once


_CHILD = """
import sys, torch
from lightning_parallel.io import atomic
d = sys.argv[1]
torch.manual_seed(0)
state = {"w": torch.randn(1_000_000)}
step = 0
print("ready", flush=True)
while True:
    step += 1
    atomic.save_checkpoint_file({**state, "step": step}, f"{d}/last.ckpt", {"step": step})
    atomic.save_checkpoint_file({**state, "step": step}, f"{d}/step={step % 3}.ckpt", {"step": step})
"""


@pytest.mark.timeout(120)
def test_sigkill_at_random_instants_leaves_only_complete_files(tmp_path):
    rng = random.Random(0)
    for kill in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpts = [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")]
        assert "last.ckpt" in ckpts or kill == 0
        for name in ckpts:
            path = str(tmp_path / name)
            assert atomic.verify_checkpoint(path).ok, name
            assert torch.load(path)["w"].numel() == 1_000_000
        atomic.remove_orphans(str(tmp_path))
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
