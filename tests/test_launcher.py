"""The launcher relies on one private Lightning method; fail loudly if Lightning moves it."""

import inspect

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from lightning_parallel.strategies.launcher import CleanExitMultiProcessingLauncher


def test_lightning_still_has_the_wrapped_private_method():
    params = list(inspect.signature(_MultiProcessingLauncher._wrapping_function).parameters)
    assert params[:7] == ["self", "process_idx", "trainer", "function", "args", "kwargs", "return_queue"]
    assert (
        CleanExitMultiProcessingLauncher._wrapping_function is not _MultiProcessingLauncher._wrapping_function
    )
