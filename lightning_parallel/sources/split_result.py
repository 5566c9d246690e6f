"""What a source's build hands the strategy: this rank's split, read-only once built."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.pipeline.runner import PipelineRunner


@dataclass(frozen=True)
class SplitResult:
    """This rank's split: the stage plan (every stage), the runner over this rank's stages, the stand-in
    the user's step calls, and the meta twin the stages are sized on (the strategy gives it the model's
    precision).

    Example::

        split = source.build(plan, inputs, module, mesh, device, warn)
        split.runner.stages.naming, split.plan.format_table()
    """

    plan: StagePlan
    runner: PipelineRunner
    call: PipelinedCall
    twin: nn.Module
