"""Atomic, hashed checkpoint files and the background writer (no Lightning, no process group).

Covers io/zip_tag.py (the hash tag in the zip comment: read back, verified, listed newest first) through the
names io/atomic.py re-exports, and _pids.py (a live writer's pid) through remove_orphans.
"""

import errno
import functools
import multiprocessing
import os
import random
import threading
import time

import pytest
import torch

from lightning_parallel.io import atomic, tempfiles
from lightning_parallel.io.async_writer import AsyncWriter, SnapshotBuffers, snapshot
from lightning_parallel.io.tempfiles import NAMED_TEMP_ENV

FORKSERVER = multiprocessing.get_context("forkserver")

METHODS = ["O_TMPFILE", "named"]


def _use(method: str, directory, monkeypatch) -> None:
    """Select the temp-file method for ``directory`` (skip O_TMPFILE where the filesystem lacks it)."""
    if method == "named":
        monkeypatch.setenv(NAMED_TEMP_ENV, "1")
    elif atomic.temp_file_method(str(directory)) != "O_TMPFILE":
        pytest.skip(f"{directory} does not support O_TMPFILE")
    assert atomic.temp_file_method(str(directory)) == method


def _state(n: int = 1000) -> dict:
    return {"model": {"w": torch.randn(n), "b": torch.arange(5)}, "step": 7, "names": ["a", "b"]}


@pytest.mark.parametrize("method", METHODS)
def test_save_is_loadable_and_verifies(tmp_path, monkeypatch, method):
    _use(method, tmp_path, monkeypatch)
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


@pytest.mark.parametrize("method", METHODS)
def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch, method):
    _use(method, tmp_path, monkeypatch)
    path = str(tmp_path / "a.ckpt")
    atomic.save_checkpoint_file({"v": torch.ones(3)}, path)
    with pytest.raises(Exception, match=r"could not write checkpoint .*a\.ckpt"):
        atomic.save_checkpoint_file({"v": torch.zeros(3), "bad": lambda: 0}, path)
    assert torch.equal(torch.load(path)["v"], torch.ones(3))
    assert os.listdir(tmp_path) == ["a.ckpt"]


@pytest.mark.parametrize("method", METHODS)
def test_a_write_in_progress_has_a_name_only_with_the_named_fallback(tmp_path, monkeypatch, method):
    _use(method, tmp_path, monkeypatch)
    seen = []

    def write(f):
        f.write(b"new")
        seen.append(sorted(os.listdir(tmp_path)))

    atomic.atomic_write(str(tmp_path / "a.ckpt"), write)  # a new name
    atomic.atomic_write(str(tmp_path / "a.ckpt"), write)  # replacing a file
    assert (tmp_path / "a.ckpt").read_bytes() == b"new" and os.listdir(tmp_path) == ["a.ckpt"]
    if method == "O_TMPFILE":
        assert seen == [[], ["a.ckpt"]]
    else:
        assert [len(names) for names in seen] == [1, 2]
        assert all(n.startswith(".a.ckpt.") and n.endswith(".partial") for n in seen[0])


def test_a_failing_link_falls_back_to_a_named_copy(tmp_path, monkeypatch):
    _use("O_TMPFILE", tmp_path, monkeypatch)
    monkeypatch.setattr(tempfiles, "_link_methods", dict(tempfiles._link_methods))
    real_link = tempfiles._link

    def link(fd, dest, method):
        if not os.path.basename(dest).startswith("."):  # the final name, not the probe
            raise OSError(errno.EXDEV, "cross-device link", dest)
        real_link(fd, dest, method)

    monkeypatch.setattr(tempfiles, "_link", link)
    atomic.save_checkpoint_file({"v": torch.arange(4)}, str(tmp_path / "a.ckpt"), {"step": 1})
    assert atomic.verify_checkpoint(str(tmp_path / "a.ckpt")).ok
    assert os.listdir(tmp_path) == ["a.ckpt"]
    assert atomic.temp_file_method(str(tmp_path)) == "named"  # that filesystem is not linked into again


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


def test_snapshot_buffers_are_reused_while_the_layout_stays():
    model = torch.nn.Linear(64, 64)
    buffers = SnapshotBuffers()
    first = buffers.snapshot({"model": model.state_dict(), "step": 1})
    held = buffers.nbytes
    assert held == sum(t.nbytes for t in model.state_dict().values())
    with torch.no_grad():
        model.weight.add_(1)
    second = buffers.snapshot({"model": model.state_dict(), "step": 2})
    # The same memory, now holding the new values (the previous snapshot was written by then).
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()
    torch.testing.assert_close(second["model"]["weight"], model.weight.detach())
    assert second["model"]["weight"].data_ptr() != model.weight.data_ptr() and buffers.nbytes == held
    # A new shape gets a new buffer; buffers the latest snapshot did not use are dropped.
    third = buffers.snapshot({"model": {"weight": torch.zeros(3)}})
    assert third["model"]["weight"].data_ptr() != first["model"]["weight"].data_ptr()
    assert buffers.nbytes == 3 * 4
    buffers.release()
    assert buffers.nbytes == 0


def test_snapshot_copies_two_views_of_one_memory_once():
    w = torch.randn(4, 4)
    state = {"a": w.detach(), "b": w.detach(), "t": w.t(), "sparse": torch.eye(3).to_sparse()}
    for snap in (snapshot(state), SnapshotBuffers().snapshot(state)):
        assert snap["a"] is snap["b"] and snap["a"].data_ptr() != w.data_ptr()
        torch.testing.assert_close(snap["t"], w.t())
        assert snap["sparse"].is_sparse and torch.equal(snap["sparse"].to_dense(), torch.eye(3))


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


def _writer(method: str, ready, work) -> None:
    """Runs in a forkserver worker (torch already imported there): announce itself, then ``work()``."""
    os.environ[NAMED_TEMP_ENV] = "1" if method == "named" else "0"
    work(ready)


def _save_forever(directory: str, ready) -> None:
    torch.manual_seed(0)
    state = {"w": torch.randn(1_000_000)}
    ready.send("ready")
    step = 0
    while True:
        step += 1
        for name in ("last.ckpt", f"step={step % 3}.ckpt"):
            atomic.save_checkpoint_file({**state, "step": step}, f"{directory}/{name}", {"step": step})


def _start_writer(method: str, work) -> tuple[multiprocessing.Process, str]:
    """A writer process, forked from the suite's forkserver (a fresh interpreter would spend seconds
    importing torch before its first write); returns it and the first thing it said."""
    reader, ready = FORKSERVER.Pipe(duplex=False)
    proc = FORKSERVER.Process(target=_writer, args=(method, ready, work), daemon=True)
    proc.start()
    ready.close()
    assert reader.poll(60), "the writer did not start"
    return proc, reader.recv()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.timeout(120)
def test_sigkill_at_random_instants_leaves_only_complete_files(tmp_path, monkeypatch, method):
    _use(method, tmp_path, monkeypatch)
    rng = random.Random(0)
    for kill in range(4 if method == "O_TMPFILE" else 2):
        proc, said = _start_writer(method, functools.partial(_save_forever, str(tmp_path)))
        assert said == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.kill()  # SIGKILL
        proc.join()
        ckpts = [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")]
        assert "last.ckpt" in ckpts or kill == 0
        for name in ckpts:
            path = str(tmp_path / name)
            assert atomic.verify_checkpoint(path).ok, name
            assert torch.load(path)["w"].numel() == 1_000_000
        atomic.remove_orphans(str(tmp_path))
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def _write_and_hang(directory: str, ready) -> None:
    def write(f):
        f.write(b"x" * (1 << 20))
        f.flush()
        ready.send("writing")
        time.sleep(60)

    atomic.atomic_write(os.path.join(directory, "new.ckpt"), write)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.timeout(60)
def test_a_kill_during_the_write_leaves_nothing_with_o_tmpfile(tmp_path, monkeypatch, method):
    _use(method, tmp_path, monkeypatch)
    proc, said = _start_writer(method, functools.partial(_write_and_hang, str(tmp_path)))
    try:
        assert said == "writing"
    finally:
        proc.kill()  # SIGKILL
        proc.join()
    left = os.listdir(tmp_path)
    if method == "O_TMPFILE":
        assert left == []
    else:
        assert len(left) == 1 and left[0].startswith(".new.ckpt.") and left[0].endswith(".partial")
        assert atomic.remove_orphans(str(tmp_path)) == [str(tmp_path / left[0])]


class _FullDisk:
    """A file with room for ``room`` bytes, which then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= size
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def fill_disk_after(monkeypatch, room: int) -> None:
    """Make checkpoint writes fail with ENOSPC once ``room`` bytes are written."""
    init = atomic._HashingWriter.__init__
    monkeypatch.setattr(atomic._HashingWriter, "__init__", lambda self, f: init(self, _FullDisk(f, room)))


@pytest.mark.parametrize("method", METHODS)
def test_a_full_disk_says_so_with_the_bytes_needed_and_free(tmp_path, monkeypatch, method):
    _use(method, tmp_path, monkeypatch)
    atomic.save_checkpoint_file(_state(), str(tmp_path / "old.ckpt"))
    fill_disk_after(monkeypatch, 2000)
    # 1000 float32 + 5 int64 = 4040 bytes of tensors; torch alone would say "unexpected pos".
    match = r"'.*new\.ckpt': the disk is full .* needs at least 4040 bytes .* has \d+ bytes \(.* MiB\) free"
    with pytest.raises(atomic.DiskFullError, match=match):
        atomic.save_checkpoint_file(_state(), str(tmp_path / "new.ckpt"))
    assert os.listdir(tmp_path) == ["old.ckpt"] and atomic.verify_checkpoint(str(tmp_path / "old.ckpt")).ok


def test_a_disk_full_error_hidden_by_torch_is_found():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 2880 vs 277") from None
    except RuntimeError as err:
        assert atomic._disk_full(err)  # from None hides the context from tracebacks, not from __context__
    assert not atomic._disk_full(RuntimeError("unexpected pos")) and not atomic._disk_full(
        OSError(errno.EIO, "")
    )
