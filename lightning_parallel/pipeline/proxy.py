"""The stand-in for the pipelined Sequential inside the user's module after the split.

It holds this rank's layers under their original names (so ``state_dict`` keys stay those of the
unsplit module: ``layers.3.weight``) and, instead of computing, either captures the input the user's
step passes to the Sequential (on the first stage) or hands back the output the pipeline computed
(on the last stage). The user's ``training_step`` therefore runs unchanged around the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn


class CapturedInput(BaseException):
    """Raised by the proxy to stop the user's step at the Sequential's input.

    A BaseException so that a broad ``except Exception`` in user code does not swallow it.
    """

    def __init__(self, args: tuple[Any, ...]) -> None:
        super().__init__()
        self.args = args


class PipelinedSequential(nn.Module):
    """This rank's layers of a split ``nn.Sequential``, keyed by their original child names.

    Example::

        proxy = PipelinedSequential({"2": block2, "3": block3}, name="layers")
        module.layers = proxy            # state_dict keys: layers.2.*, layers.3.*
        with proxy.replaying(output):
            loss = module.training_step(batch, 0)   # self.layers(x) returns `output`
    """

    def __init__(self, layers: Mapping[str, nn.Module], name: str = "layers") -> None:
        super().__init__()
        for child_name, layer in layers.items():
            self.add_module(child_name, layer)
        self._name = name
        self._mode: str | None = None
        self._output: Any = None
        self._replayed = False

    @contextmanager
    def capturing(self) -> Iterator[None]:
        with self._in_mode("capture"):
            yield

    @contextmanager
    def replaying(self, output: Any) -> Iterator[None]:
        self._output, self._replayed = output, False
        try:
            with self._in_mode("replay"):
                yield
        finally:
            self._output = None

    def capture(self, step: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """Run ``step(*args)`` up to its call of the Sequential and return that call's arguments."""
        with self.capturing():
            try:
                step(*args)
            except CapturedInput as captured:
                return captured.args
        raise RuntimeError(
            f"{getattr(step, '__name__', step)} returned without calling the pipelined Sequential "
            f"`self.{self._name}`: under PipelineStrategy every step must run the model through it"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"the pipelined Sequential `self.{self._name}` takes positional inputs only "
                f"(got keyword arguments {sorted(kwargs)})"
            )
        if self._mode == "capture":
            raise CapturedInput(args)
        if self._mode == "replay":
            if self._replayed:
                raise RuntimeError(
                    f"`self.{self._name}` was called twice in one step: under PipelineStrategy the "
                    f"pipelined Sequential may run once per step"
                )
            self._replayed = True
            return self._output
        raise RuntimeError(
            f"`self.{self._name}` holds only this rank's pipeline stage ({list(self._modules)}) and runs "
            f"inside the strategy's training/validation/test/predict steps. For inference outside "
            f"them, load the consolidated checkpoint into an unsplit module"
        )

    @contextmanager
    def _in_mode(self, mode: str) -> Iterator[None]:
        previous, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = previous
