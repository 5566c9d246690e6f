"""The Sequential path's StageSource: this rank's stage modules, torch stages built from them per shape."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.pipeline.stage_source import PreparedStage, UnitNaming
from lightning_parallel.sources.export import export_for_pipeline
from lightning_parallel.sources.sequential.split import StageModule
from lightning_parallel.sources.stage_shapes import ChainedShapes, StageExample, meta_like, run_on_fake


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
        naming: how the plan names the layers (``"layers."`` + the child's name).
        block_class: the class of the Sequential's repeated blocks (what ``compile`` compiles), read
            on the whole Sequential before the split (None: every layer).
        aliases: the unsplit module's alias table (a tensor's name -> its canonical name).

    Example::

        stages = SequentialStages([stage_module], [0], num_stages=2, device=device, group=pp_group)
        stages.build("train", 4, example)      # [PipelineStage(stage_module, 0, 2, ...)]
    """

    stage_cls: type[PipelineStage] = PipelineStage  # DeferredReduceStage once the stages are FSDP roots
    graphs = False  # its stage modules are the user's layers, held for the whole fit

    def __init__(
        self,
        modules: Sequence[StageModule],
        indices: Sequence[int],
        num_stages: int,
        device: torch.device,
        group: Any,
        twins: Sequence[nn.Module] | None = None,
        warn: Callable[[str], Any] = warnings.warn,
        naming: UnitNaming | None = None,
        block_class: type | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.naming, self.block_class = naming or UnitNaming(), block_class
        self.aliases = dict(aliases or {})
        self.modules: list[nn.Module] = list(modules)
        self.stage_indices = list(indices)
        # Each stage module as the techniques see it (each_stage): what its torch stage runs, built once.
        self.prepared = [
            PreparedStage(index, module, self.naming.named(list(module.named_children())))
            for module, index in zip(self.modules, self.stage_indices)
        ]
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

    def activate(self, stages: Sequence[Any]) -> None:
        """Each stage's ``activate``, if a technique set one (a stage module is its own for the whole fit)."""
        for stage in stages:
            prepared = self.prepared[self.stage_indices.index(stage.stage_index)]
            if prepared.activate is not None:
                prepared.activate()

    def each_stage(self, fn: Callable[[PreparedStage], Any]) -> None:
        """Call ``fn`` on each stage module now: they are built once, at the split."""
        for stage in self.prepared:
            fn(stage)

    def use_stage_class(self, cls: type[PipelineStage]) -> None:
        self.stage_cls = cls

    def build(self, mode: str, num_microbatches: int, example: tuple[Any, ...] | None) -> list[Any]:
        shapes = self._shapes(mode == "train", example) if self.twins is not None else None
        self._shapes_given = shapes is not None
        stages = []
        for module, prepared in zip(self.modules, self.prepared):
            index = prepared.index
            runs = module if prepared.runs is None else prepared.runs
            given = {"input_args": shapes[index][0], "output_args": shapes[index][1]} if shapes else {}
            stages.append(
                self.stage_cls(runs, index, self.num_stages, self.device, group=self.group, **given)
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
