"""The stand-in for the pipelined call inside the user's module: capture its input, replay its output.

After the split, the user's step still calls the model as before: ``self.layers(x)`` on the Sequential
path, ``self(x)`` (the module's ``forward``) on the traced path. The stand-in, instead of computing,
either captures the input of that call (on the first stage, to feed the schedule) or hands back the
output the pipeline computed (on the last stage). The user's ``training_step`` runs unchanged around
the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class CapturedInput(BaseException):
    """Raised by the stand-in to stop the user's step at the pipelined call's input.

    A BaseException so that a broad ``except Exception`` in user code does not swallow it.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, path: str = "") -> None:
        super().__init__()
        self.args, self.kwargs, self.path = args, kwargs or {}, path


class PipelinedCall:
    """Capture or replay one call per step of the pipelined part of the model.

    Args:
        what: how messages name the call, e.g. ``"the pipelined Sequential `self.layers`"``.
        held: what this rank holds, for the message when the call is made outside a step.

    Example::

        call = PipelinedCall("`self.forward`", "stages 0-1")
        module.forward = call                     # self(x) now goes through the stand-in
        args = call.capture(module.training_step, batch, 0)
        with call.replaying(output):
            loss = module.training_step(batch, 0)   # self(x) returns `output`
    """

    accepts_keywords = False

    def __init__(self, what: str, held: str = "") -> None:
        self.what, self.held = what, held
        # The techniques' transform of a captured call's keywords (a sequence shard's boundary labels),
        # applied before they are bound: at the split's first input and at every step alike.
        self.keyword_transform: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
        self.train = True  # whether the step being captured or replayed trains (the strategy sets it)
        self._mode: str | None = None
        self._output: Any = None
        self._replayed = False

    @property
    def mode(self) -> str | None:
        """What a call made now does: ``"capture"``, ``"replay"``, or ``None`` (outside a step: refused)."""
        return self._mode

    @property
    def replayed(self) -> Any:
        """The output :meth:`replaying` hands back (``None`` outside it)."""
        return self._output

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
        """Run ``step(*args)`` up to its pipelined call and return that call's arguments."""
        with self.capturing():
            try:
                step(*args)
            except CapturedInput as captured:
                if captured.kwargs and self.keyword_transform is not None:
                    captured.kwargs = self.keyword_transform(captured.path, captured.kwargs)
                return self.captured_input(captured)
        raise RuntimeError(
            f"{getattr(step, '__name__', step)} returned without calling {self.what}: under "
            f"PipelineStrategy every step must run the model through it"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_from("", *args, **kwargs)

    def call_from(self, path: str, *args: Any, **kwargs: Any) -> Any:
        """The stand-in's work, for a stand-in installed at module ``path`` (``""``: ``forward``)."""
        if kwargs and not self.accepts_keywords:
            raise TypeError(
                f"{self.what} takes positional inputs only under PipelineStrategy (got keyword "
                f"arguments {sorted(kwargs)}): pass them positionally"
            )
        if self._mode == "capture":
            raise CapturedInput(args, kwargs, path)
        if self._mode == "replay":
            if self._replayed:
                raise RuntimeError(
                    f"{self.what} was called twice in one step: under PipelineStrategy the pipelined "
                    f"part of the model may run once per step"
                )
            self._replayed = True
            return self._replayed_output(self._output)
        raise RuntimeError(
            f"{self.what} holds only this rank's pipeline stage ({self.held}) and runs inside the "
            f"strategy's training/validation/test/predict steps. For inference outside them, load the "
            f"consolidated checkpoint into an unsplit module"
        )

    def captured_input(self, captured: CapturedInput) -> tuple[Any, ...]:
        """What the schedule is fed for a captured call (the traced path's stand-in binds keywords)."""
        return captured.args

    def target(self, module: Any) -> Any | None:
        """The model the call goes to when the step calls it with keywords (a Hugging Face model's
        ``labels=``, read for token-exact losses), else None: a positional call names no labels."""
        return None

    def keywords(self, tensors: tuple[Any, ...] | None = None) -> dict[str, Any]:
        """The training call's keyword arguments for its captured ``tensors`` (None: placeholders); a
        positional call has none."""
        return {}

    def _replayed_output(self, output: Any) -> Any:
        return output

    @contextmanager
    def _in_mode(self, mode: str) -> Iterator[None]:
        previous, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = previous
