"""Multi-process runs on one machine, for the package's tests and experiments (private: not the API).

What ``tests/mp_harness.py`` and ``experiments/_harness.py`` both need, written once: a rendezvous port
(:func:`free_port`), N ranks with their gloo process group started and each rank's result brought back,
a failed rank's own traceback in the error (:func:`spawn`, :class:`ChildFailed`), a child process whose
failure shows its output (:func:`run_child`), and a Trainer without logger, checkpoints or progress bar
(:func:`quiet_trainer`). It lives in the package because the experiments import no test module and the
tests no experiment script, and both import the package; nothing in the package imports it.

Example::

    from lightning_parallel._testing import spawn

    def worker(rank, world, n):
        return {"rank": rank, "sum": n * rank}

    spawn(worker, 2, 10)   # [{"rank": 0, "sum": 0}, {"rank": 1, "sum": 10}]
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# ------------------------------------------------------------------------------------------- ports

PORTS = range(20000, 32000)
"""Where rendezvous ports come from: below the kernel's ephemeral range (32768-60999 by default), where
every client socket (gloo opens a mesh of them per job) takes its port. A port picked with bind(0) and
released is anyone's until the job's store binds it (EADDRINUSE, seen with two pytest workers side by
side); each pytest-xdist worker draws from its own slice of this range, in turn, so two workers never
pick the same port and a port is not picked again before thousands of others."""

_next: dict[str, int] = {}  # where this process's next search starts, per range ("" or STANDALONE_PORT)


def _worker_ports() -> range:
    """This pytest worker's slice of :data:`PORTS` (the whole range outside pytest-xdist)."""
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % count
    size = len(PORTS) // count
    return PORTS[index * size : (index + 1) * size]


def free_port() -> int:
    """A port no process listens on, for a job's ``MASTER_PORT``; a new one at each call.

    With ``STANDALONE_PORT`` set (Lightning's variable for a single-node job's port; a test that runs an
    experiment script sets it from its own range), the first free port from it upward, within 100.
    Otherwise one of this process's slice of :data:`PORTS`, in turn from a start its process id picks.

    Raises:
        RuntimeError: every port of the range is taken.

    Example::

        os.environ["MASTER_PORT"] = str(free_port())
    """
    base = os.environ.get("STANDALONE_PORT")
    ports = range(int(base), int(base) + 100) if base is not None else _worker_ports()
    key = base or ""
    if key not in _next:  # a process's first pick: from where another process would not start
        _next[key] = 0 if base is not None else os.getpid() * 7919 % len(ports)
    for _ in range(len(ports) - _next[key] if base is not None else len(ports)):
        port = ports[_next[key] % len(ports)]
        _next[key] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    where = f"the 100 from STANDALONE_PORT={base} on: unset it or pick another" if base else str(ports)
    raise RuntimeError(f"no free port in {where}")


# ------------------------------------------------------------------------------------------- ranks


class ChildFailed(RuntimeError):
    """A child failed: a rank of :func:`spawn` (the message holds the traceback of each rank that raised,
    the first one first) or a process of :func:`run_child` (its command, exit code, and the end of its
    stderr and stdout)."""


def quiet() -> None:
    """One thread, and none of Lightning's start-up chatter or warnings (an experiment's rank or main)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _rank_entry(
    rank: int, target: Callable, world: int, port: int, out_dir: str, args: tuple, how: dict
) -> None:
    # The variables a launcher like torchrun sets: Lightning then takes the processes as launched
    # externally and joins the process group started here, so a target can mix Trainer fits
    # (devices=world) with plain torch.distributed code on the same ranks. Without them Lightning would
    # believe it was started alone and start the other ranks itself by running sys.argv again. The rest
    # of the environment and the random state are the caller's (a forkserver worker starts with the
    # server's), as Lightning's spawn launcher gives its workers.
    os.environ.clear()
    os.environ.update(how["environ"], MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_rng_state(how["rng"])
    if how["quiet"]:
        quiet()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        try:
            result = target(rank, world, *args)
        except BaseException:
            # The traceback for spawn()'s error: torch reports whichever rank it saw die first, often a
            # bystander whose collective broke when the failing rank exited, not the failing rank.
            Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
            raise
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_errors(out_dir: str, target: Callable, world: int) -> str:
    """The tracebacks the ranks' ``target`` raised, the first one raised first ('' if none did)."""
    files = sorted(Path(out_dir).glob("rank*.error"), key=lambda f: f.stat().st_mtime_ns)
    name = getattr(target, "__name__", target)
    return "".join(f"--- rank {f.stem[4:]} of {world} raised in {name} ---\n{f.read_text()}" for f in files)


def spawn(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    start_method: str = "forkserver",
    preload: Sequence[str] | None = None,
    quiet_ranks: bool = False,
) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` new processes, their gloo process group started;
    return what each rank returned, by rank, brought back through files.

    Inside ``target`` a ``Trainer(accelerator="cpu", devices=world, strategy=...)`` joins these processes
    instead of launching its own. ``target`` must be a module-level function and return what
    ``torch.save`` pickles. A failure on any rank ends every rank and raises :class:`ChildFailed` with
    the traceback of each rank whose ``target`` raised, the first one first (torch's own error when a
    rank died without raising: a signal, ``os._exit``).

    Args:
        start_method: ``"forkserver"``: the ranks fork from a server that imported torch, Lightning
            and ``preload`` once (a rank starts in a fraction of a second instead of seconds of
            imports); ``"spawn"``: each rank imports everything again.
        preload: the modules the forkserver imports before it forks the ranks (read when the server
            starts: at a process's first forkserver launch); ``None`` leaves the caller's setting.
        quiet_ranks: each rank runs :func:`quiet` first.

    Example::

        def worker(rank, world, n):
            return {"rank": rank, "sum": n * rank}

        spawn(worker, 2, 10)   # [{"rank": 0, "sum": 0}, {"rank": 1, "sum": 10}]
    """
    if preload is not None:
        mp.set_forkserver_preload(list(preload))
    how = {"environ": dict(os.environ), "rng": torch.get_rng_state(), "quiet": quiet_ranks}
    with tempfile.TemporaryDirectory(prefix="lp-ranks-") as tmp:
        entry_args = (target, world, free_port(), tmp, args, how)
        try:
            mp.start_processes(_rank_entry, entry_args, nprocs=world, start_method=start_method)
        except ProcessException as err:
            raised = _rank_errors(tmp, target, world)
            if not raised:
                raise
            raise ChildFailed(f"a rank of {world} failed; first the one that raised first\n{raised}") from err
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_child(cmd: Sequence[str], env: Mapping[str, str] | None = None, tail: int = 6000) -> str:
    """Run ``cmd`` to its end and return its stdout; if it fails, raise :class:`ChildFailed` with the
    last ``tail`` characters of its stderr and stdout in the message (a bare ``CalledProcessError``
    names the command only, and the child's traceback is lost).

    Example::

        out = run_child([sys.executable, "-c", "print('hi')"], env={**os.environ, "X": "1"})
    """
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=None if env is None else dict(env))
    if proc.returncode:
        shown = " ".join(str(c) if len(str(c)) < 200 else "<...>" for c in cmd)  # (a -c program: elided)
        raise ChildFailed(
            f"child process failed with exit code {proc.returncode}: {shown}\n"
            f"--- its stderr (last {tail} characters) ---\n{proc.stderr[-tail:]}"
            f"--- its stdout (last {tail} characters) ---\n{proc.stdout[-tail:]}"
        )
    return proc.stdout


# ----------------------------------------------------------------------------------------- Trainer

QUIET = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
"""What :func:`quiet_trainer` turns off (and the CPU accelerator), unless asked for."""


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU ``Trainer`` without logger, checkpoints, progress bar or model summary, unless asked for.

    Example::

        quiet_trainer(devices=2, strategy="ddp", max_steps=20).fit(model, loader)
    """
    return L.Trainer(**{**QUIET, **kwargs})
