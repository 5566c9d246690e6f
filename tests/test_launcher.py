"""The launcher relies on one private Lightning method; fail loudly if Lightning moves it."""

import inspect

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

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
