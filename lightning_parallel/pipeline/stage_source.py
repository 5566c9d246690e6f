"""The one interface between the pipeline's runtime and where a rank's stages come from.

Two sources implement it (:mod:`lightning_parallel.sources`): the Sequential path's ``SequentialStages``
(a top-level ``nn.Sequential`` cut into stage modules, held for the whole fit) and the traced path's
``TracedStages`` (``forward`` exported once, each stage's graph prepared when an input first needs it).
The runner (:mod:`lightning_parallel.pipeline.runner`) and the techniques
(:mod:`lightning_parallel.techniques`) call only what is declared here; the strategy picks the source
once, when it splits the module, and nothing else asks which one it holds.

The techniques see the stages through the stage view, the same verbs on both sources: what holds them
(``modules``), each stage module as it is prepared (``each_stage``, a :class:`PreparedStage` whose
``runs`` and ``activate`` a technique may set), the torch stage class (``use_stage_class``) and a few
facts (``naming``, ``graphs``, ``aliases``, ``block_class``); and the module before its split as an
:class:`UnsplitModel`. No source imports a technique, no technique a source.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn
from torch.distributed.pipelining import PipelineStage


@dataclass(frozen=True)
class UnitNaming:
    """How a source names its units in the plan: ``prefix`` + the unit (``"layers."`` on the Sequential
    path). ``blocks``: the block list's path (``"h."``) where ``True`` recomputes the blocks only, not the
    embeddings or the head the first and last stages also call (nothing to gain there).

    Example::

        >>> UnitNaming("layers.").named([("3", None)])
        [('layers.3', None)]
    """

    prefix: str = ""
    blocks: str | None = None

    def named(self, units: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``units`` named as the plan names them."""
        return [(self.prefix + name, unit) for name, unit in units]


@dataclass(frozen=True)
class UnsplitModel:
    """The module before its split, as its source is about to split it: what a technique reads on all of
    it first (``Technique.before_split``: a tensor-parallel plan resolved on every stage's layers, the same
    on every rank; a refusal of what the stages will not take).

    Args:
        module: the LightningModule, whole.
        layers: the module the units are found in: the ``nn.Sequential`` the source splits, or the
            module itself when its forward is traced.
        path: the path of ``layers`` in ``module`` (``"layers"``; ``""`` for the module itself).
        graphs: the stages will be export graphs (:attr:`StageSource.graphs`).

    Example::

        model = UnsplitModel(lit_module, lit_module.layers, "layers", graphs=False)
    """

    module: nn.Module
    layers: nn.Module
    path: str = ""
    graphs: bool = False


@dataclass(eq=False)
class PreparedStage:
    """One of this rank's stage modules as its source prepared it, for the techniques' per-stage work
    (:meth:`StageSource.each_stage`).

    Args:
        index: the stage's index in the pipeline.
        module: the stage module, changed in place by the techniques: a run of the Sequential's layers,
            or a traced stage's export graph (one per traced program).
        units: the units it calls, named as the plan names them (``"layers.3"``, ``"h.2"``).
        graph_modules: the modules inside ``module`` that run a graph, with their paths in it (``""``:
            the stage module itself); ``[]`` for a stage of the user's own modules.
        runs: what the torch stage runs in the module's place (a module wrapping it), None: the module.
        activate: called before a schedule of this stage steps (a module that runs several stages'
            graphs told which one to run), or None.

    Example::

        def wrap(stage: PreparedStage) -> None:
            if stage.index == 0:
                stage.runs = OwnInputs(stage.module)
    """

    index: int
    module: nn.Module
    units: list[tuple[str, nn.Module]] = field(default_factory=list)
    graph_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    runs: nn.Module | None = None
    activate: Callable[[], Any] | None = None


class FirstInput(Protocol):
    """The pipelined call's input before the training loop runs, as a source reads it to split.

    The strategy's is the module's ``example_input_array`` or its first batch's step run up to the call
    (``strategies/pipeline/call_input.py``). ``training``: whether the job fits (else it evaluates);
    ``keywords``: the techniques' transform of the pipelined call's keywords (the source gives it to the
    call it makes: ``PipelinedCall.keyword_transform``), or None.
    """

    training: bool
    keywords: Callable[[str, dict[str, Any]], dict[str, Any]] | None

    def example(self) -> tuple[Any, ...] | None:
        """The module's ``example_input_array`` as call arguments, or None."""
        ...

    def capture(self, capture: Any) -> tuple[Any, ...]:
        """Run the current stage's step on its first batch until ``capture`` (a stand-in with a
        ``capture(step, *args)`` method) stops it at the pipelined call; that call's arguments."""
        ...


class StageSource(Protocol):
    """Where this rank's torch ``PipelineStage`` objects come from, for each new input shape; and the
    stage view the techniques act on.

    The runner calls :attr:`needs_example`, :attr:`shapes_given`, :meth:`build`, :meth:`output_merge_spec`,
    :meth:`merging` and :meth:`activate`. The techniques (``Technique.stages``) see this rank's stages
    through the rest, the same on both sources: :attr:`modules` (what holds the stages for the whole
    fit), :meth:`each_stage` (each stage module, now or as it is prepared), :meth:`use_stage_class`, and
    the facts :attr:`naming`, :attr:`graphs`, :attr:`aliases` and :attr:`block_class`.

    Example::

        source: StageSource = SequentialStages([stage_module], [0], num_stages=2, device=d, group=g)
        source.each_stage(lambda stage: print(stage.index, [name for name, _ in stage.units]))
        if source.needs_example:              # every rank must then pass the first micro-batch
            example = first_microbatch(args, num_microbatches)
        stages = source.build("train", num_microbatches, example)
        source.activate(stages)
        schedule.step(...)
    """

    stage_indices: list[int]  # this rank's stages, in the order build() returns them
    # --- the stage view (the techniques)
    naming: UnitNaming  # how its units are named in the plan (recomputation, the stage table)
    # Whether each stage module is an export graph, prepared per traced program at its first build: it
    # reads the user's tensors directly and calls none of the user's modules (no module hooks run).
    graphs: bool
    aliases: Mapping[str, str]  # the unsplit module's alias table (a tensor's name -> its canonical name)
    block_class: type | None  # the class of the model's repeated blocks (compiled alone), None: not known
    # What holds this rank's stages for the whole fit, changed in place by the techniques: each stage
    # module of the user's layers, or the one module holding the tensors a traced stage's graphs read.
    # A technique that wraps one puts its wrapper in its place (FSDP2's root of a traced stage).
    modules: list[nn.Module]

    def each_stage(self, fn: Callable[[PreparedStage], Any]) -> None:
        """Call ``fn`` on each of this rank's stages now, and on each stage prepared later (a traced
        stage's module is prepared per traced program, at its first build), after the ``fn`` given before."""
        ...

    def use_stage_class(self, cls: type[PipelineStage]) -> None:
        """Build later stages as ``cls`` (a ``PipelineStage`` subclass: FSDP2's deferred reduction)."""
        ...

    # --- the runner
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

    def activate(self, stages: Sequence[PipelineStage]) -> None:
        """Before a cached schedule steps: each of its stages' ``PreparedStage.activate``."""
        ...
