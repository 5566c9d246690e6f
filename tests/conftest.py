"""Suite-wide settings: one thread per process, and no process outlives its test."""

import multiprocessing
import os

# Set before torch is imported anywhere, so spawned ranks inherit it: on 2 cores, N ranks with
# several OpenMP threads each only fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolate_distributed_state():
    """Leave no rank, process group or rendezvous port behind for the next test.

    A rank stuck in a collective after a timeout is killed. An in-process Trainer with a DDP-based
    strategy (devices=1) initialises a process group whose store keeps listening on MASTER_PORT,
    and writes MASTER_ADDR/MASTER_PORT (and other launch variables) into os.environ: Lightning would
    reuse the port for the next spawn run (EADDRINUSE), and a script started by a later test would
    believe it was launched externally. The environment is restored as it was before the test.
    """
    environ = dict(os.environ)
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
