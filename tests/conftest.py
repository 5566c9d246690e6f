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
def _kill_orphaned_ranks():
    """Kill any child process a test leaves behind (a rank stuck in a collective after a timeout)."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
