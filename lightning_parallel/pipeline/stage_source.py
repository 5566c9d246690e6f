"""The one interface between the pipeline's runtime and where a rank's stages come from.

Two sources implement it: :class:`~lightning_parallel.pipeline.split.SequentialStages` (a top-level
``nn.Sequential`` cut into stage modules, held for the whole fit) and
:class:`~lightning_parallel.traced.split.TracedStages` (``forward`` exported once, each stage's graph
prepared when an input first needs it). The runner (:mod:`lightning_parallel.pipeline.runner`), the
memory options and the parallelize step call only what is declared here; the strategy picks the
source once, when it splits the module, and nothing else asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import nn
from torch.distributed.pipelining import PipelineStage

# Called with (unit name, module) pairs: the units a stage runs, named as the source names them.
UnitsHook = Callable[[list[tuple[str, nn.Module]]], Any]


class StageSource(Protocol):
    """Where this rank's torch ``PipelineStage`` objects come from, for each new input shape.

    Example::

        source: StageSource = SequentialStages([stage_module], [0], num_stages=2, device=d, group=g)
        if source.needs_example:              # every rank must then pass the first micro-batch
            example = first_microbatch(args, num_microbatches)
        stages = source.build("train", num_microbatches, example)
        with source.step_context():
            schedule.step(...)
    """

    stage_indices: list[int]  # this rank's stages, in the order build() returns them

    @property
    def needs_example(self) -> bool:
        """Whether building a new shape's stages needs its first micro-batch, on every rank alike."""
        ...

    @property
    def shapes_given(self) -> bool:
        """Whether the stages last built were given their send and receive shapes (torch's static
        mode); if not, torch infers them at the schedule's first step, which needs a loss to call."""
        ...

    def build(self, mode: str, num_microbatches: int, example: tuple[Any, ...] | None) -> list[PipelineStage]:
        """This rank's torch stages for ``mode`` (``"train"`` or ``"eval"``) and micro-batches shaped
        as ``example`` (None when :attr:`needs_example` is False)."""
        ...

    def output_merge_spec(self, num_microbatches: int) -> Any:
        """How the last stage's micro-batch outputs merge (torch's ``output_merge_spec``; None: dim 0)."""
        ...

    def merging(self, weights: Sequence[float] | None) -> AbstractContextManager[None]:
        """While a forward-only step runs: what each micro-batch counts for when scalar outputs merge."""
        ...

    def step_context(self) -> AbstractContextManager[Any]:
        """Around each schedule step."""
        ...

    def activate(self, stages: Sequence[PipelineStage]) -> None:
        """Before a cached schedule steps: make shared modules run that schedule's stages."""
        ...

    def recompute(self, wrap: UnitsHook) -> None:
        """Call ``wrap`` on this rank's units: now, or on each stage's units as the stage is prepared."""
        ...

    def use_stage_class(self, cls: type[PipelineStage]) -> None:
        """Build later stages as ``cls`` (a ``PipelineStage`` subclass: FSDP2's deferred reduction)."""
        ...
