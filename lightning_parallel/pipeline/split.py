"""Find the pipelined nn.Sequential in a module, check it can be split, and keep only this rank's stages."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.pipeline.proxy import PipelinedSequential


def find_sequential(module: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential]:
    """The attribute name and the ``nn.Sequential`` that the pipeline splits.

    Raises:
        ValueError: none found, several found without ``module_name``, or ``module_name`` is no Sequential.
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
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no top-level nn.Sequential to pipeline: put the layers in one, "
            f"e.g. `self.layers = nn.Sequential(embedding, *blocks, norm, head)`"
        )
    if len(found) > 1:
        raise ValueError(
            f"{type(module).__name__} has several top-level nn.Sequential children "
            f"({', '.join(n for n, _ in found)}): pass PipelineStrategy(module_name=...) to pick one"
        )
    return found[0]


def check_parameters_inside(module: nn.Module, seq_name: str) -> None:
    """Refuse parameters outside the pipelined Sequential: no stage would own their gradients."""
    outside = [n for n, _ in module.named_parameters() if not n.startswith(f"{seq_name}.")]
    if outside:
        shown = ", ".join(outside[:5]) + (" ..." if len(outside) > 5 else "")
        raise ValueError(
            f"parameters outside the pipelined Sequential `{seq_name}`: {shown}. Under PipelineStrategy "
            f"every parameter must belong to a stage: move these layers inside `self.{seq_name}`"
        )


def check_no_shared_parameters(seq: nn.Sequential, counts: Sequence[int]) -> None:
    """Refuse parameters shared between stages (tied weights): each stage owns its own tensors."""
    owner: dict[int, tuple[int, str]] = {}
    names = list(seq._modules)
    stage_of_layer = [s for s, c in enumerate(counts) for _ in range(c)]
    for layer_pos, layer_name in enumerate(names):
        for pname, p in seq[layer_pos].named_parameters(remove_duplicate=False):
            stage = stage_of_layer[layer_pos]
            first = owner.setdefault(id(p), (stage, f"{layer_name}.{pname}"))
            if first[0] != stage:
                raise ValueError(
                    f"parameter {first[1]} (stage {first[0]}) is shared with {layer_name}.{pname} "
                    f"(stage {stage}): tied weights across pipeline stages are not supported; untie them, "
                    f"or choose a partition that keeps both layers in one stage"
                )


def layer_facts(seq: nn.Sequential) -> tuple[list[str], list[str], list[int]]:
    """Child names, class names and parameter counts of each layer (meta tensors count too)."""
    names = list(seq._modules)
    types = [type(seq[i]).__name__ for i in range(len(seq))]
    params = [sum(p.numel() for p in seq[i].parameters()) for i in range(len(seq))]
    return names, types, params


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


def split(
    module: nn.Module,
    seq_name: str,
    seq: nn.Sequential,
    plan: StagePlan,
    pp_rank: int,
    device: torch.device,
) -> tuple[PipelinedSequential, list[StageModule], list[int]]:
    """Keep this rank's layers: install the proxy in ``module`` and return the stage modules.

    The other stages' layers are dropped here, so a model built on the meta device never
    materialises them; this rank's layers are materialised on ``device``.
    """
    local = plan.local_stages(pp_rank)
    stage_modules, kept = [], OrderedDict()
    for spec in local:
        layers = OrderedDict((name, seq._modules[name]) for name in spec.layer_names)
        for layer in layers.values():
            materialize(layer, device)
        stage_modules.append(StageModule(layers, spec.index))
        kept.update(layers)
    proxy = PipelinedSequential(kept, name=seq_name)
    setattr(module, seq_name, proxy)
    materialize(module, device)
    return proxy, stage_modules, [s.index for s in local]


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate meta tensors on ``device`` and initialise them with the layers' reset_parameters()."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return
    module.to_empty(device=device)
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
