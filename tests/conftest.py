"""Suite-wide settings: one thread per process, no process outlives its test, no patch outlives it."""

import multiprocessing
import multiprocessing.forkserver
import os

# Set before torch is imported anywhere, so spawned ranks inherit it: on 2 cores, N ranks with
# several OpenMP threads each only fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")

import lightning.fabric.plugins.environments.lightning as _lightning_environment
import mp_harness
import pytest
import torch
from global_state import changes, snapshot

torch.set_num_threads(1)

# The suite starts its ranks with forkserver (mp_harness.START_METHOD): the server, started at the
# first launch with this environment, imports these once and every rank is forked from it (hf_preload:
# transformers, peft and litgpt, which the Hugging Face tests' ranks would each import).
multiprocessing.set_forkserver_preload(
    ["lightning_parallel", "lightning.pytorch", "mp_harness", "tiny_models", "hf_preload"]
)

# Lightning's launchers take a free port with bind(0), from the kernel's ephemeral range, where gloo's
# client sockets take theirs: with two pytest workers a port it picked was taken before the job's store
# bound it (EADDRINUSE). The suite's jobs take theirs from mp_harness.free_port (a range below it, a
# slice per worker); a job a test starts as a script is given one through STANDALONE_PORT.
_lightning_environment.find_free_network_port = mp_harness.free_port

# Variables a launcher writes into the main process's environment. A later run that finds them
# believes it was launched externally, or reuses a port a leftover store still holds (EADDRINUSE).
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
_SESSION_LAUNCH_ENV = {k: os.environ[k] for k in _LAUNCH_VARIABLES if k in os.environ}


def pytest_configure(config):
    """Refuse to run as a rank another process launched: a test started pytest again.

    Lightning's script launcher starts ranks 1.. by running ``sys.argv`` again with ``LOCAL_RANK`` set:
    a multi-device Trainer in a test process without a launched environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``) would start the whole suite again in the background, where it slows every test and
    its jobs collide with this session's. Ending here fails the test that launched it instead.
    """
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if local_rank != "0":
        pytest.exit(
            f"pytest was started as local rank {local_rank} by a launcher (Lightning's script launcher runs "
            f"sys.argv again): a test ran Trainer(devices>1) in a process without RANK, LOCAL_RANK and "
            f"WORLD_SIZE set. Set them in the test's ranks (mp_harness.spawn_gloo does)",
            returncode=3,
        )


def pytest_collection_modifyitems(config, items):
    """Files with a ``slow`` test first, then files with a ``multiprocess`` test, then the others (in
    their order, each file's tests kept in order): with ``make test``'s workers (pytest-xdist, a file at
    a time) the long jobs start first and the many short files fill the cores around them, instead of
    one long job running alone at the end (test_watchdog.py's minute of spawned jobs came last)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    spawning = {item.path for item in items if item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: 0 if item.path in slow else 1 if item.path in spawning else 2)


@pytest.fixture(scope="session", autouse=True)
def _forkserver_finds_the_tests_modules(request):
    """Start this worker's forkserver with the tests' folder on its ``PYTHONPATH``.

    The server is a fresh interpreter started with this process's environment, and Python 3.11's
    ``forkserver.main`` drops the ``sys.path`` it is handed: started lazily, it found ``lightning_parallel``
    and Lightning but not the tests' modules, and skipped their preload without a word (an ImportError
    there is ignored), so every rank imported them, and the Hugging Face tests' ranks transformers, again.
    Started here, at the first test (a worker's, not the xdist controller's), it preloads them all; a
    session without a ``multiprocess`` test starts no server (its preloads cost seconds of CPU).
    """
    if not any(item.get_closest_marker("multiprocess") for item in request.session.items):
        yield
        return
    tests = os.path.dirname(os.path.abspath(__file__))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests, before) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    yield


@pytest.fixture(autouse=True)
def _isolate_distributed_state():
    """Leave no rank, process group or rendezvous port behind for the next test.

    A rank stuck in a collective after a timeout is killed. An in-process Trainer with a DDP-based
    strategy (devices=1) initialises a process group whose store keeps listening on MASTER_PORT,
    and writes MASTER_ADDR/MASTER_PORT (and other launch variables) into os.environ: Lightning would
    reuse the port for the next spawn run (EADDRINUSE), and a script started by a later test would
    believe it was launched externally. The environment is restored as it was before the test, and
    launch variables a module- or session-scoped fixture left behind are dropped before it.
    """
    for key in _LAUNCH_VARIABLES:
        if key in _SESSION_LAUNCH_ENV:
            os.environ[key] = _SESSION_LAUNCH_ENV[key]
        else:
            os.environ.pop(key, None)
    environ = dict(os.environ)
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(autouse=True)
def _no_global_state_left_behind(request):
    """Fail the test that leaves torch.distributed, the pipeline schedule or torch's flags changed.

    The cheap guard against order dependence (see global_state.py): whatever a test patches, the next
    test would otherwise inherit, so the suite would pass or fail by the order its files run in.
    """
    before = snapshot()
    yield
    if left := changes(before, snapshot()):
        pytest.fail(
            f"{request.node.nodeid} left global state changed for the tests after it: {'; '.join(left)}. "
            "Restore it in the test (monkeypatch, or try/finally)",
            pytrace=False,
        )


@pytest.fixture
def one_rank(monkeypatch):
    """A world of one gloo rank in this process, for tests of collectives without a spawn."""
    from mp_harness import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
