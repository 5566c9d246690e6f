"""Distributed checkpoint directories under SIGKILL: one rank, or every rank, at random points of the saves.

Two gloo ranks save tiny DCP directories in a loop (synchronously, or in the background on the
checkpoint group: the code Rank0Checkpoint runs for PipelineStrategy(save_distributed_checkpoint=True))
until the test kills one of them or both. After every kill: every directory listed is complete, the one
``ckpt_path="last"`` would take is the newest complete one and holds exactly that step's state, at
most the save in flight was lost, and the next start removes what the kill left. The ranks are forked
from the suite's forkserver: a kill costs a fraction of a second. ``experiments/bench_dcp_faults.py``
runs the campaign with real Trainers (and resumes them) for docs/results.md.
"""

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from mp_harness import START_METHOD, free_port

from lightning_parallel import Rank0Checkpoint
from lightning_parallel.checkpoint import directory
from lightning_parallel.checkpoint.directory_async import background_writer, save_checkpoint_dir_async
from lightning_parallel.checkpoint.distributed import read_all
from lightning_parallel.io.async_writer import SnapshotBuffers

KILLS = 32
KEEP = 3  # rank 0 removes older directories once a newer one is published, as top-k eviction does


def _state(step: int, rank: int) -> dict:
    """Rank ``rank``'s shard of the state at ``step``: its own keys, and a replicated one (written once)."""
    shard = torch.arange(20_000, dtype=torch.float32) + 1000 * step + rank
    return {"state_dict": {f"layer{rank}.weight": shard, "shared": torch.full((64,), float(step))}}


def _save_loop(rank: int, world: int, port: int, out: str, background: bool, first: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    writer, buffers = background_writer(), SnapshotBuffers()
    started = Path(out) / "started.log"
    for step in range(first, first + 10_000):
        if background and (error := writer.wait()) is not None:  # the previous one is published
            with open(Path(out) / f"error-rank{rank}.txt", "w") as f:
                f.write(f"{time.time()} {type(error).__name__}: {error}")
            raise error
        if rank == 0:
            with open(started, "a") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
        path = os.path.join(out, "ckpt", f"step={step}.ckpt")
        tag = {"step": step, "epoch": 0, "key": "kills", "name": os.path.basename(path)}
        meta = {"global_step": step}
        if background:
            save_checkpoint_dir_async(path, _state(step, rank), meta, tag, writer, buffers)
        else:
            state = _state(step, rank)
            directory.write_checkpoint_dir(path, lambda tmp, s=state: _dcp_save(s, tmp), meta, tag)
        if rank == 0 and step - KEEP >= first:
            directory.remove_dir(os.path.join(out, "ckpt", f"step={step - KEEP}.ckpt"))


def _dcp_save(state: dict, tmp: str) -> None:
    dcp.save(state, checkpoint_id=tmp)


def _check_after_kill(out: Path, first: int) -> tuple[int, int]:
    """The invariants after a kill; returns (the newest complete step, the temporary entries left)."""
    ckpt = out / "ckpt"
    left = [n for n in os.listdir(ckpt) if n.endswith(".partial")]
    listed = directory.list_tagged_dirs(str(ckpt))
    for path, _ in listed:  # nothing incomplete is ever listed
        assert directory.verify_checkpoint_dir(path).ok, f"a listed directory does not verify: {path}"
    newest = Rank0Checkpoint(dirpath=str(ckpt))._find_last_checkpoints(None)  # what ckpt_path="last" takes
    steps = sorted(int(tag["step"]) for _, tag in listed)
    started = [int(s) for s in (out / "started.log").read_text().split()]
    assert steps and newest == {str(ckpt / f"step={steps[-1]}.ckpt")}, (newest, steps)
    assert steps[-1] >= started[-1] - 1, f"saves {started[-1] - 1}.. lost, not only the one in flight"
    state = read_all(next(iter(newest)))  # the newest holds exactly its step's state, every rank's part
    for rank in (0, 1):
        expected = _state(steps[-1], rank)["state_dict"]
        for key, value in expected.items():
            assert torch.equal(state[f"state_dict.{key}"], value), (steps[-1], key)
    Rank0Checkpoint(dirpath=str(ckpt))._prepare_dir()  # the next start: a killed run's leftovers go
    assert not [n for n in os.listdir(ckpt) if n.endswith(".partial")]
    assert [p for p, _ in directory.list_tagged_dirs(str(ckpt))] == [p for p, _ in listed]
    for path, tag in listed:  # the next run keeps the one it resumes from
        if int(tag["step"]) != steps[-1]:
            directory.remove_dir(path)
    return steps[-1], len(left)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigkill_of_one_rank_or_every_rank_during_distributed_saves(tmp_path):
    rng = random.Random(36)
    context = mp.get_context(START_METHOD)
    (tmp_path / "ckpt").mkdir()
    first, mid_save, outcomes = 0, 0, []
    for kill in range(KILLS):
        background, victims = kill % 2 == 1, ([0, 1] if kill % 4 < 2 else [rng.choice([0, 1])])
        args = (2, free_port(), str(tmp_path), background, first)
        ranks = [context.Process(target=_save_loop, args=(r, *args), daemon=True) for r in (0, 1)]
        for p in ranks:
            p.start()
        try:
            deadline = time.monotonic() + 60
            while not _published_since(tmp_path, first) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.25))  # a random point of the saves that follow
            killed_at = time.time()
            for r in victims:
                os.kill(ranks[r].pid, signal.SIGKILL)
            for p in ranks:  # a survivor fails on its dead peer, or is ended as a launcher would
                p.join(3)
        finally:
            for p in ranks:
                if p.is_alive():
                    p.kill()
                p.join()
        for error in tmp_path.glob("error-rank*.txt"):  # a survivor's error after the kill is expected
            when, text = error.read_text().split(" ", 1)
            assert float(when) >= killed_at, f"a background save failed before the kill: {text}"
            error.unlink()
        try:
            newest, left = _check_after_kill(tmp_path, first)
        except AssertionError as err:
            raise AssertionError(f"kill {kill} (background={background}, ranks {victims}): {err}") from err
        mid_save += left > 0
        outcomes.append((background, len(victims), newest - first + 1, left))
        first = newest + 1
    # The kills landed inside saves (a temporary directory was there), not only between them.
    assert mid_save >= KILLS // 4, outcomes
    print(f"{KILLS} kills, {mid_save} inside a save (a temporary directory left, removed at the next start)")


def _published_since(out: Path, first: int) -> bool:
    return any(int(tag["step"]) >= first for _, tag in directory.list_tagged_dirs(str(out / "ckpt")))
