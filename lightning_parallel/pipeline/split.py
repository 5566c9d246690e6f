"""The Sequential path: find the module's nn.Sequential, plan its stages, keep only this rank's layers."""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.pipeline.export import export_for_pipeline
from lightning_parallel.pipeline.plan import StagePlan, describe_layers
from lightning_parallel.pipeline.pretrained import load_pending
from lightning_parallel.pipeline.proxy import PipelinedSequential
from lightning_parallel.pipeline.stage_shapes import ChainedShapes, StageExample, meta_like, run_on_fake
from lightning_parallel.pipeline.twin import alias_table, meta_twin, retie


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


class SequentialStages:
    """This rank's stage modules of a split Sequential; the runner builds torch stages from them per shape.

    Args:
        modules, indices: this rank's stage modules and their stage indices.
        num_stages, device, group: the pipeline's stage count, this rank's device, the pipeline group.
        twins: every stage's layers on the meta device (:func:`stage_twins`), run on fake tensors to
            give each new input shape's stages their send and receive shapes (torch's static mode:
            no dummy forward and backward at the first step). Without them (or where the layers
            cannot run on fake tensors) torch infers the shapes at each new schedule's first step.
        warn: how to say once that the shapes are inferred by torch (``rank_zero_warn`` in the strategy).

    Example::

        stages = SequentialStages([stage_module], [0], num_stages=2, device=device, group=pp_group)
        stages.build("train", 4, example)      # [PipelineStage(stage_module, 0, 2, ...)]
    """

    stage_cls: type[PipelineStage] = PipelineStage  # DeferredReduceStage once the stages are FSDP roots

    def __init__(
        self,
        modules: Sequence[StageModule],
        indices: Sequence[int],
        num_stages: int,
        device: torch.device,
        group: Any,
        twins: Sequence[nn.Module] | None = None,
        warn: Callable[[str], Any] = warnings.warn,
    ) -> None:
        self.modules, self.stage_indices = list(modules), list(indices)
        self.num_stages, self.device, self.group = num_stages, device, group
        self.twins = list(twins) if twins is not None else None
        self.warn = warn
        # Per mode: the twins exported once with dynamic sizes (at a third shape), or False where
        # export cannot capture them; until then (and where it cannot) each shape runs them on fakes.
        self._chained: dict[bool, ChainedShapes | bool] = {}
        self._shapes_seen: dict[bool, set[tuple]] = {}
        self._shapes_given = self.twins is not None  # whether the last build gave torch the shapes

    # --- the StageSource interface (pipeline/stage_source.py)
    @property
    def needs_example(self) -> bool:
        """Whether every rank needs the first micro-batch's input to build a new shape's stages."""
        return self.twins is not None

    @property
    def shapes_given(self) -> bool:
        """Whether the stages last built were given their shapes (sized on the fake-tensor twins)."""
        return self._shapes_given

    def output_merge_spec(self, num_microbatches: int) -> None:
        return None  # the last stage's outputs concatenate on dim 0, torch's default

    def merging(self, weights: Sequence[float] | None) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # (no scalar outputs to merge)

    def step_context(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def activate(self, stages: Sequence[Any]) -> None:
        """Nothing to do: each stage's module is its own for the whole fit."""

    def recompute(self, wrap: Callable[[list[tuple[str, nn.Module]]], Any]) -> None:
        """Wrap this rank's layers now: the stage modules are built once."""
        wrap(self.units())

    def use_stage_class(self, cls: type[PipelineStage]) -> None:
        self.stage_cls = cls

    def build(self, mode: str, num_microbatches: int, example: tuple[Any, ...] | None) -> list[Any]:
        shapes = self._shapes(mode == "train", example) if self.twins is not None else None
        self._shapes_given = shapes is not None
        stages = []
        for module, index in zip(self.modules, self.stage_indices):
            given = {"input_args": shapes[index][0], "output_args": shapes[index][1]} if shapes else {}
            stages.append(
                self.stage_cls(module, index, self.num_stages, self.device, group=self.group, **given)
            )
        return stages

    def _shapes(self, train: bool, example: tuple[Any, ...] | None) -> list[StageExample] | None:
        assert self.twins is not None
        if example is None:
            raise RuntimeError("internal error: a new Sequential schedule needs the input on every rank")
        chained = self._chained.get(train)
        if isinstance(chained, ChainedShapes):
            served = chained.examples(example)
            if served is not None:
                return served
        for twin in self.twins:
            twin.train(train)
        try:
            fake = run_on_fake(self.twins, example, train, self.device)
        except Exception as err:  # any layer may refuse fake tensors (a value read with .item())
            self.warn(
                f"PipelineStrategy: the Sequential's layers could not run on fake tensors to size the "
                f"stages ({type(err).__name__}: {err}); torch infers each new batch shape's stage shapes "
                f"at its first step instead (one more forward and backward of a micro-batch per shape)"
            )
            self.twins = None
            return None
        shapes = [tuple(tuple(meta_like(t) for t in ts) for ts in pair) for pair in fake]
        self._learn_dynamic_sizes(train, example, shapes)
        return shapes

    def _learn_dynamic_sizes(self, train: bool, example: tuple[Any, ...], shapes: list[StageExample]) -> None:
        """At a mode's third input shape, export the twins with dynamic sizes: later shapes cost nothing.

        Data of one length (and its epoch's short last batch) never pays the export; data whose lengths
        vary pays it once.
        """
        seen = self._shapes_seen.setdefault(train, set())
        seen.add(tuple(tuple(t.shape) for t in example if torch.is_tensor(t)))
        if len(seen) < 3 or train in self._chained:
            return
        try:
            self._chained[train] = ChainedShapes.export(self.twins, shapes, train, export_for_pipeline)
        except Exception:  # a layer export cannot capture: its shapes keep coming from fake runs
            self._chained[train] = False

    def units(self) -> list[tuple[str, nn.Module]]:
        """The layers of this rank's stages (what activation checkpointing may wrap)."""
        return [(name, layer) for m in self.modules for name, layer in m.named_children()]


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


def materialize(module: nn.Module, device: torch.device, aliases: dict[str, str] | None = None) -> None:
    """Allocate meta tensors on ``device``, re-tie shared weights, initialise with ``reset_parameters()``."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return
    aliases = alias_table(module) if aliases is None else aliases
    module.to_empty(device=device)
    retie(module, aliases)
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    _init_like_hugging_face(module)
    load_pending(module)


def _init_like_hugging_face(module: nn.Module) -> None:
    """Initialise what a Hugging Face model's own ``_init_weights`` covers (norms, rotary tables...).

    ``reset_parameters`` leaves the RMS norms' weights and the buffers computed in ``__init__`` (the
    rotary ``inv_freq``, Gemma's embedding scale) as ``to_empty`` left them: garbage. Duck-typed, so
    this module does not import transformers.
    """
    done: set[int] = set()
    for owner in module.modules():
        init = getattr(owner, "_init_weights", None)
        if id(owner) in done or not callable(init) or getattr(owner, "config", None) is None:
            continue
        with torch.no_grad():
            for sub in owner.modules():
                done.add(id(sub))
                init(sub)
