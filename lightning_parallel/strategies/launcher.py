"""Lightning's spawn/fork launcher: the process group released when a worker finishes, and stops that stop."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.multiprocessing.spawn import ProcessExitedException
from typing_extensions import override

from lightning_parallel._picklable import check_picklable
from lightning_parallel.distributed.collectives import barrier
from lightning_parallel.distributed.stop import DEFAULT_GRACE, StopGuard, exit_status, stopped_status
from lightning_parallel.distributed.stop_forwarding import forwarding_stop_signals
from lightning_parallel.sources.twin import alias_table, retie
from lightning_parallel.strategies._main_guard import refuse_unguarded_launch
from lightning_parallel.strategies.pipeline.refusals import refuse_compiled_module


class CleanExitMultiProcessingLauncher(_MultiProcessingLauncher):
    """Destroy the process group at the end of each spawned or forked worker.

    Lightning 2.6.6 relies on an ``atexit`` hook to destroy the process group, which spawn workers
    never run; measured on CPU/gloo, about 1 in 10 ``ddp_spawn`` fits then died with SIGABRT
    ("terminate called without an active exception") after training had finished. Releasing the
    group explicitly, once the worker's results are on the queue, removes that exit path.
    ``_wrapping_function`` is private to Lightning (checked against 2.6.6); test_launcher.py fails
    loudly if it goes away.

    A spawn or forkserver launch from a script without ``if __name__ == "__main__":`` is refused in
    the main process, before any worker starts (see ``_main_guard``: otherwise it can hang). A
    forkserver worker gets the main process's environment and global state, as a spawn worker does
    (:func:`forkserver_parent_state`).

    A stop is a stop (the strategy's ``stop_grace_period``, 30 s by default): SIGTERM or SIGINT to the
    main process goes on to every worker, which then has that long to stop (Lightning stops the fit at
    the next batch); the workers still alive are then killed, and the main process exits with 128 +
    the signal (SIGINT: Lightning's KeyboardInterrupt path), as it does when the workers stopped by
    themselves (a signal to one of them, or to each). Each worker dies with the main process and ends
    itself ``stop_grace_period`` after a stop, also when it is blocked in a collective
    (:class:`~lightning_parallel.distributed.stop.StopGuard`).
    """

    _parent_state: tuple[_GlobalStateSnapshot, dict[str, str]] | None = None
    _launcher_pid: int | None = None

    @property
    def stop_grace_period(self) -> float:
        return float(getattr(self._strategy, "stop_grace_period", DEFAULT_GRACE))

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self._start_method in ("spawn", "forkserver"):
            refuse_unguarded_launch(self._start_method)
        if self._start_method == "forkserver":
            self._parent_state = forkserver_parent_state(self._strategy)
        self._launcher_pid = os.getpid()  # travels to the workers with the launcher

        def workers() -> list:  # this launch's (a previous one's are dead), or those still starting
            return [p for p in self.procs if p.is_alive()] or multiprocessing.active_children()

        try:
            with forwarding_stop_signals(workers, self.stop_grace_period):
                return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as err:
            # Ranks told to stop (one of them, or each by its scheduler) exit with 128 + the signal, or
            # die of it: the job then ends with that status too.
            status = stopped_status(err.exit_code)
            if status is None:
                raise
            raise SystemExit(status) from err
        finally:
            self._parent_state = None

    @override
    def _wrapping_function(
        self, process_idx: int, trainer: Any, function: Callable, args: Any, kwargs: Any, *rest: Any
    ) -> None:
        guard = self._start_guard(process_idx)
        try:
            self._run_worker(process_idx, trainer, function, args, kwargs, *rest)
        except (SystemExit, KeyboardInterrupt) as stop:
            signalled = guard is not None and guard.exit_code is not None
            if not signalled and not isinstance(stop, SIGTERMException):
                raise
            # Stopped (also a rank that Lightning stopped with the others): the stop's status, and no
            # interpreter teardown (see below).
            _flush()
            os._exit(guard.exit_code if signalled else exit_status(signal.SIGTERM))

    def _start_guard(self, process_idx: int) -> StopGuard | None:
        """In the worker: the stop guard, and the default signal handlers (a fork inherits the launcher's)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self._launcher_pid is None:
            return None
        node = self._strategy.cluster_environment.node_rank() if self._strategy.cluster_environment else 0
        rank = node * self._strategy.num_processes + process_idx
        grace = self.stop_grace_period
        return StopGuard(grace, f"rank {rank}", launcher=self._launcher_pid).start()

    def _run_worker(
        self, process_idx: int, trainer: Any, function: Callable, args: Any, kwargs: Any, *rest: Any
    ) -> None:
        if self._parent_state is not None:
            snapshot, environ = self._parent_state
            os.environ.clear()
            os.environ.update(environ)
            snapshot.restore()
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                # torch.multiprocessing hands a worker the model's CPU tensors in shared memory: every
                # rank would train the same weights. Lightning copies them for spawn workers only.
                # Lightning workaround: no upstream issue found
                #   canary: test_lightning_gives_a_forkserver_worker_what_it_gives_a_spawn_worker
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        # Only on success: after an exception the launcher ends every rank anyway, and a destroy
        # with collectives still pending could block.
        # Lightning workaround: https://github.com/Lightning-AI/pytorch-lightning/pull/8080
        #   canary: test_lightning_spawn_worker_destroys_its_process_group
        if dist.is_available() and dist.is_initialized():
            barrier()  # no rank tears down while a peer still talks to it
            dist.destroy_process_group()
        # Rank 0's results are already in the queue (a SimpleQueue writes synchronously). Leaving
        # without interpreter teardown avoids the C++ threads of gloo objects still referenced from
        # Python being destroyed joinable at exit, the source of the SIGABRT above (still 1 in 20
        # pipeline fits with the destroy alone).
        _flush()
        os._exit(0)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


# Lightning workaround: no upstream issue found
#   canary: test_lightning_gives_a_forkserver_worker_what_it_gives_a_spawn_worker
def forkserver_parent_state(strategy: Any) -> tuple[_GlobalStateSnapshot, dict[str, str]]:
    """What a forkserver worker needs from the main process, and the imports its server preloads.

    A forkserver worker is forked from a server process started once, so it starts in a fraction
    of a second instead of importing torch and Lightning again (~7 s per rank on 2 cores), but it
    inherits the server's environment and random state, not the main process's: Lightning 2.6
    passes its global state snapshot (seeds, deterministic flags) to spawn workers only, and sets
    ``MASTER_PORT`` in the main process's environment. Both are taken here and restored in the
    worker, which also copies the model's tensors out of the shared memory they arrive in. (The
    server imports the main script's imports once: Python's default preload is ``__main__``;
    ``multiprocessing.set_forkserver_preload`` names others.)

    Example::

        snapshot, environ = forkserver_parent_state(trainer.strategy)   # in the main process
    """
    os.environ["MASTER_PORT"] = str(strategy.cluster_environment.main_port)
    return _GlobalStateSnapshot.capture(), dict(os.environ)


class PipelineMultiProcessingLauncher(CleanExitMultiProcessingLauncher):
    """Bring the full trained weights of every stage back to the main process after fit.

    Lightning sends rank 0's ``module.state_dict()`` back; under PipelineStrategy that is one stage.
    The consolidated state dict (a collective, so every rank takes part) replaces it, and the user's
    unsplit module in the main process then holds every stage's weights, as after ``ddp_spawn``.
    Overrides Lightning's private ``_collect_rank_zero_results`` (2.6.6); test_launcher.py checks it.
    A module compiled with ``torch.compile(model)`` is refused in the main process, before it is pickled
    for the workers (it cannot be: Lightning puts the compiled methods on the instance), and so is a
    ``parallelize_fn`` or ``activation_checkpointing`` function that cannot be pickled (a lambda), by name.
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if args:  # Lightning's fit/validate/test/predict pass the (unwrapped) LightningModule first
            refuse_compiled_module(args[0])
        if self._start_method in ("spawn", "forkserver"):
            refuse_unpicklable_options(self._strategy.parallel_plan)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        state_dict = trainer.strategy.lightning_module_state_dict()
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or output.weights_path is None:
            return output
        self._strategy.checkpoint_io.save_checkpoint(state_dict, output.weights_path)
        return output

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        # A model built under init_module(empty_init=True) is still on the meta device here, where
        # load_state_dict would silently copy nothing: give it storage to receive the weights.
        module = trainer.lightning_module
        if worker_output.weights_path is not None and any(p.is_meta for p in module.parameters()):
            aliases = alias_table(module)
            module.to_empty(device="cpu")
            retie(module, aliases)  # to_empty gives each name of a tied weight its own tensor
        super()._recover_results_in_main_process(worker_output, trainer)


def refuse_unpicklable_options(plan: Any) -> None:
    """Raise ``pickle.PicklingError`` naming a PipelineStrategy function option that cannot be pickled.

    A spawn or forkserver launch pickles the strategy with the Trainer; pickle's own error would name
    the function only, not the option it was given as.

    Example::

        refuse_unpicklable_options(strategy.parallel_plan)   # before the launch pickles the Trainer
    """
    for name in ("parallelize_fn", "activation_checkpointing"):
        value = getattr(plan, name)
        if callable(value):
            check_picklable(value, f"PipelineStrategy({name}={{}})")
