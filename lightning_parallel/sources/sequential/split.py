"""The Sequential path's finder and split: find the module's nn.Sequential (its units are its layers), plan
its stages, keep only this rank's layers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_parallel.pipeline.plan import StagePlan, describe_layers
from lightning_parallel.sources.materialize import materialize
from lightning_parallel.sources.sequential.call import PipelinedSequential
from lightning_parallel.sources.twin import alias_table, meta_twin


def find_sequential(module: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential] | None:
    """The attribute name and the top-level ``nn.Sequential`` that the pipeline splits, or None.

    Raises:
        ValueError: several found without ``module_name``, or ``module_name`` is no Sequential.
    """
    if module_name is not None:
        target = getattr(module, module_name, None)
        if not isinstance(target, nn.Sequential):
            raise ValueError(
                f"module_name={module_name!r} names a {type(target).__name__}, not an nn.Sequential: "
                f"name the top-level nn.Sequential that holds the layers to pipeline"
            )
        return module_name, target
    found = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Sequential)]
    if len(found) > 1:
        raise ValueError(
            f"{type(module).__name__} has several top-level nn.Sequential children "
            f"({', '.join(n for n, _ in found)}): pass PipelineStrategy(module_name=...) to pick one"
        )
    return found[0] if found else None


def check_parameters_inside(module: nn.Module, seq_name: str) -> None:
    """Refuse parameters outside the pipelined Sequential: no stage would own their gradients."""
    outside = [n for n, _ in module.named_parameters() if not n.startswith(f"{seq_name}.")]
    if outside:
        shown = ", ".join(outside[:5]) + (" ..." if len(outside) > 5 else "")
        raise ValueError(
            f"parameters outside the pipelined Sequential `{seq_name}`: {shown}. Under PipelineStrategy "
            f"every parameter must belong to a stage: move these layers inside `self.{seq_name}`, or "
            f"pass PipelineStrategy(split_points=[...]) to split the module's forward instead"
        )


def layer_facts(seq: nn.Sequential) -> tuple[list[str], list[str], list[int]]:
    """Child names, class names and parameter counts of each layer (meta tensors count too)."""
    names = list(seq._modules)
    types = [type(seq[i]).__name__ for i in range(len(seq))]
    params = [sum(p.numel() for p in seq[i].parameters()) for i in range(len(seq))]
    return names, types, params


def stage_descriptions(seq: nn.Sequential, counts: Sequence[int]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The child names each stage runs and the table's description of them."""
    names, types, _ = layer_facts(seq)
    units, holds, start = [], [], 0
    for count in counts:
        span = slice(start, start + count)
        units.append(tuple(names[span]))
        holds.append(describe_layers(names[span], types[span]))
        start += count
    return units, holds


def stage_parameters(
    module: nn.Module, seq_name: str, stage_units: Sequence[Sequence[str]]
) -> list[frozenset[str]]:
    """The canonical names of the parameters each stage uses (a tied weight has one name)."""
    aliases = alias_table(module)
    seq = getattr(module, seq_name)
    out = []
    for units in stage_units:
        names = {
            aliases[f"{seq_name}.{unit}.{pname}"]
            for unit in units
            for pname, _ in seq._modules[unit].named_parameters(remove_duplicate=False)
        }
        out.append(frozenset(names))
    return out


class StageModule(nn.Sequential):
    """One stage: a run of the Sequential's layers, checking what it hands to the next stage."""

    def __init__(self, layers: OrderedDict[str, nn.Module], index: int) -> None:
        super().__init__(layers)
        self.stage_index = index

    def forward(self, *args: Any) -> Any:
        # A tuple sent between stages arrives as several arguments; a Sequential passes it on whole.
        x: Any = args[0] if len(args) == 1 else args
        for layer in self:
            x = layer(x)
        if not (torch.is_tensor(x) or (isinstance(x, tuple) and x and all(map(torch.is_tensor, x)))):
            raise TypeError(
                f"pipeline stage {self.stage_index} (layers {list(self._modules)}) returned a "
                f"{type(x).__name__}: a stage must output a tensor or a tuple of tensors. Move the stage "
                f"boundary with partition=[...] or make the layer return tensors"
            )
        return x


def stage_twins(seq: nn.Sequential, plan: StagePlan) -> list[StageModule]:
    """Every stage's layers of ``seq`` on the meta device (ties kept): what sizes the stages for a shape."""
    twin = meta_twin(seq)
    return [
        StageModule(OrderedDict((name, twin._modules[name]) for name in stage.units), stage.index)
        for stage in plan.stages
    ]


def split_sequential(
    module: nn.Module, seq_name: str, seq: nn.Sequential, plan: StagePlan, pp_rank: int, device: torch.device
) -> tuple[PipelinedSequential, list[StageModule], list[int]]:
    """Keep this rank's layers: install the stand-in in ``module`` and return the stage modules.

    The other stages' layers are dropped here, so a model built on the meta device never
    materialises them; this rank's layers are materialised on ``device``.
    """
    local = plan.local_stages(pp_rank)
    aliases = alias_table(module)
    stage_modules, kept = [], OrderedDict()
    for spec in local:
        layers = OrderedDict((name, seq._modules[name]) for name in spec.units)
        stage_modules.append(StageModule(layers, spec.index))
        kept.update(layers)
    proxy = PipelinedSequential(kept, name=seq_name)
    setattr(module, seq_name, proxy)
    materialize(module, device, aliases)
    return proxy, stage_modules, [s.index for s in local]
