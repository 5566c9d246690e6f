"""Run a Lightning Trainer on N CPU processes (gloo, spawn) and bring every rank's results back.

The tests use Lightning the way users do: ``Trainer(accelerator="cpu", devices=N, strategy=...)``.
Each rank writes what the test wants to see to ``out_dir/rank{R}.pt`` when fitting ends, so the
test reads all ranks, not only the rank-0 value that Lightning's spawn launcher returns.

The ports, the ranks and the quiet Trainer are ``lightning_parallel/_testing.py``'s, which the
experiments' harness (``experiments/_harness.py``) shares; what only the tests need is here: the
records each rank writes, the references on one device, the comparisons, the leftover-process checks.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_parallel import _testing as testing
from lightning_parallel._testing import free_port, spawn
from lightning_parallel.distributed.dtensors import full_tensors, local
from lightning_parallel.strategies.launcher import CleanExitMultiProcessingLauncher

__all__ = [
    "START_METHOD",
    "GatheredRecorder",
    "RankRecorder",
    "SaveAtEpochEnd",
    "SpawnDDPStrategy",
    "assert_close_dicts",
    "ddp_spawn",
    "fit",
    "free_port",
    "load_rank_results",
    "merged_params",
    "merged_records",
    "process_lines",
    "processes_with_env",
    "quiet_trainer",
    "reference_loader",
    "spawn_gloo",
]


# How the suite starts its ranks: forkserver workers are forked from a server that imported torch,
# Lightning and this package once (conftest.py names them), so a rank starts in well under a second
# instead of ~7 s of imports on 2 cores; the launchers restore the main process's environment and
# seeds in each worker, as spawn does. test_launcher.py and test_pipeline_launchers.py keep "spawn".
START_METHOD = "forkserver"


class SpawnDDPStrategy(DDPStrategy):
    """Lightning's ``ddp_spawn``, with the launcher that releases the process group at worker exit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(start_method=kwargs.pop("start_method", START_METHOD), **kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = CleanExitMultiProcessingLauncher(self, start_method=self._start_method)


def ddp_spawn(**kwargs: Any) -> SpawnDDPStrategy:
    """The DDP strategy the tests use where a user would write ``strategy="ddp_spawn"``."""
    return SpawnDDPStrategy(**kwargs)


def reference_loader(dataset: Dataset, global_batch_size: int, seed: int = 0) -> DataLoader:
    """A one-process loader whose step k holds exactly the samples that N ranks see together at step k.

    Lightning injects ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED or 0)`` into every training
    loader of a multi-process run (even one built with ``shuffle=False``). Rank r takes
    ``perm[r::N]`` of that sampler's permutation, so the N batches of step k together are
    ``perm[k*B*N:(k+1)*B*N]``: the same sampler with one replica yields them in this order.
    """
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=global_batch_size, sampler=sampler)


class RankRecorder(Callback):
    """Record the per-step training loss and the final parameters of every rank into ``out_dir``."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = str(out_dir)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            self.losses.append(float(loss))

    def _dump(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "losses": self.losses,
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "extra": getattr(pl_module, "recorded", None),
        }
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(record, os.path.join(self.out_dir, f"{stage}-rank{trainer.global_rank}.pt"))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._dump(trainer, pl_module, "fit")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self._dump(trainer, pl_module, "validate")


def fit(
    model: L.LightningModule,
    train_dataloaders: Any,
    out_dir: str | os.PathLike,
    devices: int = 1,
    strategy: Any = "auto",
    val_dataloaders: Any = None,
    ckpt_path: Any = None,
    **trainer_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit ``model`` on ``devices`` CPU processes and return the records of every rank, by rank."""
    callbacks = [*trainer_kwargs.pop("callbacks", []), RankRecorder(out_dir)]
    # Lightning's default checkpoints and logs go under the run's directory, not the working directory.
    trainer_kwargs.setdefault("default_root_dir", out_dir)
    trainer = quiet_trainer(devices=devices, strategy=strategy, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(
        model, train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders, ckpt_path=ckpt_path
    )
    return load_rank_results(out_dir, "fit")


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or summary unless asked for, one epoch."""
    return testing.quiet_trainer(**{"max_epochs": 1, **kwargs})


def load_rank_results(out_dir: str | os.PathLike, stage: str = "fit") -> list[dict[str, Any]]:
    """Read back the ``rank{R}.pt`` records that the ranks wrote, ordered by global rank."""
    paths = glob.glob(str(Path(out_dir) / f"{stage}-rank*.pt"))
    records = [torch.load(p, weights_only=False) for p in paths]
    records.sort(key=lambda r: r["rank"])
    if not records:
        raise AssertionError(f"no rank wrote its results to {out_dir}")
    return records


def merged_params(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every rank's parameters in one dict: the stages of a pipeline together (replicas agree)."""
    merged: dict[str, torch.Tensor] = {}
    for r in records:
        merged.update(r["params"])
    return merged


class GatheredRecorder(Callback):
    """Per rank, for sharded stages (FSDP2, tensor parallel): the losses, the full (gathered) parameters,
    and how each parameter is held at the start, ``(type, placements, local shape)``; saved to ``path``
    when fitting ends. Gathering is a collective: every rank records.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path, self.losses, self.held = str(path), [], {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.held = {
            n: (type(p).__name__, str(getattr(p, "placements", "")), tuple(local(p).shape))
            for n, p in pl_module.named_parameters()
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def extra(self, trainer, pl_module) -> dict[str, Any]:
        """More to save beside the losses, parameters and placements (a subclass's)."""
        return {}

    def on_fit_end(self, trainer, pl_module) -> None:
        params = {k: v.detach().cpu() for k, v in full_tensors(pl_module.state_dict()).items()}
        record = {"losses": self.losses, "params": params, "held": self.held}
        torch.save({**record, **self.extra(trainer, pl_module)}, self.path)


class SaveAtEpochEnd(Callback):
    """Every rank saves a checkpoint (gathered or sharded: the strategy's) at the end of the first epoch."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def merged_records(out_dir: Path, name: str, world: int) -> tuple[dict, torch.Tensor, list[dict]]:
    """The ``{name}-rank{R}.pt`` records of every rank: parameters merged, losses averaged over ranks."""
    records = [torch.load(out_dir / f"{name}-rank{r}.pt", weights_only=False) for r in range(world)]
    losses = torch.tensor([r["losses"] for r in records]).mean(0)
    return merged_params(records), losses, records


def assert_close_dicts(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Assert two state dicts have the same keys and numerically close values; name the worst key."""
    assert set(actual) == set(expected), (
        f"keys differ: missing {sorted(set(expected) - set(actual))}, "
        f"unexpected {sorted(set(actual) - set(expected))}"
    )
    worst = max(
        ((k, (actual[k].double() - expected[k].double()).abs().max().item()) for k in expected),
        key=lambda kv: kv[1],
        default=("", 0.0),
    )
    for k in expected:
        torch.testing.assert_close(
            actual[k], expected[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}"
        )
    assert worst[1] <= atol + rtol * 10, f"largest difference {worst[1]:.3e} at {worst[0]}"


def processes_with_env(entry: str) -> list[int]:
    """PIDs of the processes whose environment holds ``entry`` ("NAME=value"): a job's leftover ranks.

    A process's environment here is the one it started with (``/proc/PID/environ``): a forkserver worker
    shows its server's, not the variables its launcher set in it. This process's own multiprocessing
    helpers are left out (:func:`_session_helper`).
    """
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry.encode() in f.read().split(b"\0") and not _session_helper(pid):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def process_lines(pids: list[int]) -> list[str]:
    """``pid: state, parent, command line`` of each of ``pids`` still running (one that is gone is left
    out): what a leftover-rank assertion shows."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append(f"{pid}: state {fields[0].decode()}, parent {int(fields[1])}, {command[:300]}")
    return out


def _session_helper(pid: str) -> bool:
    """Whether ``pid`` is this process's multiprocessing resource tracker or forkserver.

    Each starts at the first launch that needs it, with that moment's environment (alone, the first
    test's), serves every later launch and lives as long as pytest: not a job's process. A forkserver
    worker has the server's command line but the server as its parent, so it still counts.
    """
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read()
    if b"multiprocessing.resource_tracker" not in command and b"multiprocessing.forkserver" not in command:
        return False
    with open(f"/proc/{pid}/stat", "rb") as f:
        parent = int(f.read().rsplit(b")", 1)[1].split()[1])  # "pid (name) state ppid ..."
    return parent == os.getpid()


def script_env(root: str | os.PathLike) -> dict[str, str]:
    """The environment for an experiment script a test runs: one thread, the repository importable, and
    ``STANDALONE_PORT`` from this worker's range (experiments/_harness.py takes its ports from there)."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root), STANDALONE_PORT=str(free_port()))


def kill_jobs(jobs: list[mp.ProcessContext]) -> None:
    """Kill every process of ``jobs`` still alive."""
    for process in (p for job in jobs for p in job.processes if p.is_alive()):
        process.kill()


def join_jobs(jobs: list[mp.ProcessContext]) -> None:
    """Wait for every job started with ``join=False``; a rank's failure raises here, and ends the other
    jobs' ranks too."""
    try:
        while not all([job.join(timeout=0.2) for job in jobs]):  # (a list: every job polled each time)
            pass
    finally:
        kill_jobs(jobs)


def run_ranks(target: Any, args: list[tuple], timeout: float) -> list[int | None]:
    """Start one process of ``target`` per argument tuple (``START_METHOD``), wait up to ``timeout``
    seconds for each, kill what is still alive (a hang fails its test instead of the suite), and return
    the exit codes, by rank."""
    context = mp.get_context(START_METHOD)
    ranks = [context.Process(target=target, args=a) for a in args]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()
    return [p.exitcode for p in ranks]


def spawn_gloo(fn: Any, world: int, out_dir: str | os.PathLike) -> list[Any]:
    """Run ``fn(rank, world, out_dir)`` on ``world`` ranks (forkserver, the gloo process group started:
    ``lightning_parallel._testing.spawn``) and return the ``out_dir/rank{R}.pt`` records they saved.

    Each rank saves what the test checks to ``out_dir/rank{R}.pt``; the records come back by rank. The
    ranks' environment says how they were launched (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``NODE_RANK``), as torchrun's does: a Trainer in ``fn`` joins this world. Without them Lightning
    believes it was started alone and starts the other ranks itself by running ``sys.argv`` again:
    under the suite, a second pytest session in the background.
    """
    spawn(fn, world, str(out_dir), start_method=START_METHOD)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
