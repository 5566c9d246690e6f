"""The launcher: the private Lightning methods it relies on, and the unguarded-script check before spawn."""

import inspect
import os
import subprocess
import sys

import pytest
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from lightning_parallel.strategies._main_guard import runs_unguarded, unguarded_launch_line
from lightning_parallel.strategies.launcher import (
    CleanExitMultiProcessingLauncher,
    PipelineMultiProcessingLauncher,
)


def test_lightning_still_has_the_wrapped_private_method():
    params = list(inspect.signature(_MultiProcessingLauncher._wrapping_function).parameters)
    assert params[:7] == ["self", "process_idx", "trainer", "function", "args", "kwargs", "return_queue"]
    assert (
        CleanExitMultiProcessingLauncher._wrapping_function is not _MultiProcessingLauncher._wrapping_function
    )


def test_lightning_still_has_the_result_hooks_the_pipeline_launcher_overrides():
    collect = list(inspect.signature(_MultiProcessingLauncher._collect_rank_zero_results).parameters)
    recover = list(inspect.signature(_MultiProcessingLauncher._recover_results_in_main_process).parameters)
    assert collect == ["self", "trainer", "results"]
    assert recover == ["self", "worker_output", "trainer"]
    # the consolidated weights are written to the path Lightning's own collection chose
    assert "weights_path" in inspect.getsource(_MultiProcessingLauncher._collect_rank_zero_results)
    for name in ("_collect_rank_zero_results", "_recover_results_in_main_process"):
        assert getattr(PipelineMultiProcessingLauncher, name) is not getattr(_MultiProcessingLauncher, name)


UNGUARDED = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from tiny_models import SequentialRegressor, loader, regression_data
from lightning_parallel import PipelineStrategy


class Model(SequentialRegressor):
    def __init__(self):
        super().__init__()
        self.vocabulary = [f"token-{{i}}" for i in range(100_000)]  # ~1 MB pickled: more than a pipe holds


strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2, start_method="spawn")
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False)
trainer.fit(Model(), loader(regression_data(16), 8))
"""


@pytest.mark.timeout(120)
def test_a_spawn_launch_from_an_unguarded_script_fails_at_once_with_the_line_to_move(tmp_path):
    # Without the check this script hung: its workers died re-running it, while the main process
    # waited to finish writing the 1 MB pickled Trainer into the first worker's start-up pipe.
    script = tmp_path / "train.py"
    source = UNGUARDED.format(tests=os.path.dirname(__file__))
    script.write_text(source)
    line = 1 + next(i for i, text in enumerate(source.splitlines()) if text.startswith("trainer.fit("))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"running {script} again from the top, and line {line} (`trainer.fit(Model()" in run.stderr
    assert 'if __name__ == "__main__":' in run.stderr and "Initializing distributed" not in run.stderr


@pytest.mark.parametrize(
    ("source", "line", "unguarded"),
    [
        ("trainer.fit(model)\n", 1, True),
        ('if __name__ == "__main__":\n    trainer.fit(model)\n', 2, False),
        ("if '__main__' == __name__:\n    main()\n", 2, False),
        ('try:\n    if __name__ == "__main__":\n        main()\nexcept KeyError:\n    pass\n', 3, False),
        ('def main():\n    trainer.fit(model)\n\nmain()\nif __name__ == "__main__":\n    pass\n', 4, True),
        ("if DEBUG:\n    trainer.fit(model)\n", 2, True),
        ("def (:\n", 1, False),  # nothing to say: Lightning's own check in the worker stays
    ],
)
def test_the_guard_is_found_around_the_line_that_launches(source, line, unguarded):
    assert runs_unguarded(source, line) is unguarded


def test_tests_and_notebooks_launch_without_being_refused():
    # pytest's __main__ is guarded; a notebook or `python -c` has no script to run again.
    assert unguarded_launch_line() is None
