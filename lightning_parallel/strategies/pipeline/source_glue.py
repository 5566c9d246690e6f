"""What the strategy does differently for each stage source, picked once where the source is built.

The Sequential path and the traced path hand the runner one interface
(:class:`~lightning_parallel.pipeline.stage_source.StageSource`); what the strategy's own glue must
know of a source beyond it — how its units are named, how its stages are parallelized and compiled —
lives here, in one object per source that ``sequential_path`` / ``traced_path`` return beside the
runner. The memory options and the parallelize step call it and never ask which source they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.pipeline.split import SequentialStages
from lightning_parallel.plan.checks import CompileOptions
from lightning_parallel.techniques.parallelize import ParallelizeFn, parallelize_stages
from lightning_parallel.techniques.recompute import UnitNaming
from lightning_parallel.techniques.tensor_parallel.apply import apply_held_styles
from lightning_parallel.techniques.tensor_parallel.plan import TensorPlan
from lightning_parallel.traced.fsdp import ShardedTracedStage, shard_traced_stage
from lightning_parallel.traced.split import TracedStages


@dataclass(frozen=True)
class ParallelizeRequest:
    """What the parallelize step asks of a source: the strategy's options, resolved on this rank."""

    device_mesh: DeviceMesh | None  # the whole mesh (its "tp" dimension for tensor parallelism)
    shard_mesh: DeviceMesh | None  # the data-parallel mesh FSDP2 shards over
    data_parallel: str
    parallelize_fn: ParallelizeFn | None
    tensor_plan: TensorPlan | None
    compile: CompileOptions | None


class SourceGlue(Protocol):
    """The strategy's per-source glue (see the module docstring)."""

    naming: UnitNaming

    def parallelize(self, module: nn.Module, request: ParallelizeRequest) -> list[nn.Module]:
        """Parallelize this rank's stages in place (torchtitan's order); returns the FSDP2 roots."""
        ...

    def compiled(self, options: CompileOptions) -> str:
        """What ``compile=`` compiles on this source, for the rank-0 line at setup."""
        ...


@dataclass
class SequentialGlue:
    """The Sequential path: its stage modules are parallelized as modules, its repeated blocks compiled.

    ``seq_name``: the Sequential's path in the LightningModule; ``blocks``: the class of its repeated
    layers, read before the split (None: every layer is compiled, no class repeats).
    """

    stages: SequentialStages
    seq_name: str
    blocks: type | None
    naming: UnitNaming

    def parallelize(self, module: nn.Module, request: ParallelizeRequest) -> list[nn.Module]:
        names = [[f"{self.seq_name}.{c}" for c, _ in m.named_children()] for m in self.stages.modules]
        return parallelize_stages(
            self.stages.modules,
            request.device_mesh,
            request.shard_mesh,
            request.data_parallel,
            request.parallelize_fn,
            request.tensor_plan,
            names,
            request.compile,
            self.blocks,
        )

    def compiled(self, options: CompileOptions) -> str:
        what = f"its {self.blocks.__name__} layers" if self.blocks is not None else "its layers"
        return f"each stage compiles {what} in place (torch.compile, {options})"


@dataclass
class TracedGlue:
    """The traced path: tensor parallelism on the held modules (the graphs run on DTensors), each
    stage's program compiled as it is prepared, FSDP2 on one root per stage.

    ``refuse_traced_parallelize`` (the config) lets only tensor parallelism and FSDP2 reach here.
    """

    stages: TracedStages
    naming: UnitNaming

    def parallelize(self, module: nn.Module, request: ParallelizeRequest) -> list[nn.Module]:
        if request.compile is not None:  # compiled as each program is prepared
            self.stages.compile_with(request.compile)
        roots = []
        tp_mesh = None
        if request.tensor_plan is not None:
            assert request.device_mesh is not None
            tp_mesh = request.device_mesh["tp"]
            self.stages.split_over(tp_mesh, apply_held_styles(module, request.tensor_plan, tp_mesh))
        if request.data_parallel == "fsdp":
            root = ShardedTracedStage(module, tp_mesh)
            self.stages.shard_with(root)
            roots = [shard_traced_stage(root, request.shard_mesh)]
        return roots

    def compiled(self, options: CompileOptions) -> str:
        return f"each stage's program is compiled (torch.compile, {options})"
