"""Lightning's script launcher for PipelineStrategy: its ranks die with rank 0, and a stop is not a crash.

Rank 0 of a script launch (Lightning's default launcher) starts ranks 1.. by running the script again.
Here their environment names rank 0's pid (their stop guard makes them die with it), and Lightning's
watch over them stands down once rank 0 was told to stop (see :class:`StoppingScriptLauncher`).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_parallel.distributed.stop import LAUNCHER_PID_ENV, stop_received

__all__ = ["StoppingScriptLauncher"]


class StoppingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, whose ranks know rank 0 started them: they die with it.

    Rank 0 starts ranks 1.. by running the script again (``_call_children_scripts``, private to
    Lightning 2.6.6; ``tests/test_stop.py`` checks it); their environment then names rank 0's pid.
    Lightning's watch over them (a rank that ended with an error ends every process, rank 0 with
    SIGKILL) stands down once rank 0 was told to stop: its end is bounded by its stop guard, and its
    ranks end on the way (on Lightning's KeyboardInterrupt path rank 0 kills them itself, then exits
    with 1; after SIGTERM each exits with 143 when it is done, rank 0 perhaps last).

    Example::

        launcher = StoppingScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    """

    @override
    def _call_children_scripts(self) -> None:
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            super()._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER_PID_ENV, None)

    # Lightning workaround: no upstream issue found
    #   canary: test_lightning_script_launcher_lets_its_main_process_exit_after_killing_its_ranks
    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning 2.6.6's launch, with the watch below in place of Lightning's own.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _StopAwareObserver(main_pid=os.getpid(), child_processes=self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _StopAwareObserver(_ChildProcessObserver):
    """Lightning's watch over the ranks rank 0 started, which stands down once rank 0 was told to stop.

    Every 5 s it SIGKILLs every process, rank 0 too, if a rank ended with an error: a stopped rank
    (killed by rank 0 on Lightning's KeyboardInterrupt path, or ended with 143) that ended before rank
    0 did turned rank 0's status (1, 143) into -9 when a poll fell in between.
    """

    @override
    def _run(self) -> bool:
        if stop_received() is not None:
            return True  # stopping, within its guard's grace period: done watching
        return super()._run()
