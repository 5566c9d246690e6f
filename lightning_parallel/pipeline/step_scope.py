"""Whether the user's step code runs on this rank right now, and which collectives it may issue there.

Under a pipeline the user's step runs on the last stage (once per micro-batch in training), and on the
first stage up to the pipelined call (to capture its input). The ranks that run one of those pieces are
the data- and tensor-parallel ranks of one pipeline rank: a collective there over any other rank would
wait forever. :class:`StepScope` marks the step's code while it runs; inside it the strategy's
collectives (``self.all_gather``, ...) use the step's data-parallel group, metrics compute locally, and
a ``torch.distributed`` collective over other ranks is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from lightning_parallel.distributed.collective_guard import collectives_limited_to

__all__ = ["CollectiveOutsideStepError", "StepScope"]


class CollectiveOutsideStepError(RuntimeError):
    """A ``torch.distributed`` collective in a step, over ranks that do not run that step.

    Raised under ``PipelineStrategy`` on every rank, at the first such call; the message names the
    call and the fix.

    Example::

        def validation_step(self, batch, batch_idx):
            loss = self.loss(batch)
            torch.distributed.all_reduce(loss)     # CollectiveOutsideStepError: the world group
            torch.distributed.all_reduce(loss, group=self.trainer.strategy.data_parallel_group)  # runs
    """


class StepScope:
    """Marks the user's step code on this rank: ``"capture"`` (up to the pipelined call) or ``"replay"``.

    Args:
        step_ranks: the global ranks that run the same pieces of every step as this rank (its pipeline
            rank's data- and tensor-parallel ranks); ``None`` when every rank runs every step.

    In ``"replay"`` a collective over other ranks raises :class:`CollectiveOutsideStepError`. In
    ``"capture"`` it is skipped (returns ``None``): the step stops at the model call anyway, and the
    last stage, which runs the whole step again, raises the error, which reaches every rank.

    Example::

        scope = StepScope(frozenset({2, 3}))
        with scope.running("replay"):
            scope.active                 # True: strategy collectives use the step's group
            dist.barrier()               # CollectiveOutsideStepError: names the call and the fix
    """

    def __init__(self, step_ranks: frozenset[int] | None = None) -> None:
        self.step_ranks = step_ranks
        self.mode: str | None = None

    @property
    def active(self) -> bool:
        return self.mode is not None

    @contextmanager
    def running(self, mode: str) -> Iterator[None]:
        previous, self.mode = self.mode, mode
        guard = (
            collectives_limited_to(self.step_ranks, self._refused)
            if self.step_ranks is not None and previous is None
            else nullcontext()
        )
        try:
            with guard:
                yield
        finally:
            self.mode = previous

    def _refused(self, name: str) -> Any:
        if self.mode == "capture":
            return None
        raise CollectiveOutsideStepError(
            f"torch.distributed.{name} was called in a step over ranks that do not run it: under "
            f"PipelineStrategy the step runs on the last pipeline stage (and, up to the model call, on "
            f"the first), so a collective over the default (world) group would wait forever for the "
            f"other stages. Use self.all_gather(...) or self.trainer.strategy.reduce(...) (in a step they "
            f"run over the data-parallel ranks of the stage that runs it), or pass "
            f"group=self.trainer.strategy.data_parallel_group"
        )
