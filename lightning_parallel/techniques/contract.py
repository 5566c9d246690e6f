"""What a technique is to the rest of the package: one base class whose members are all optional.

A technique (recomputation, tensor parallelism, FSDP2, offload, ...) is one module that defines one
subclass of :class:`Technique` and one instance of it (``TECHNIQUE``); ``techniques/__init__.py`` holds
them in one ordered tuple, and every composer folds that tuple: the plan (its fields' canonical
values, its refusals, its label), the planner's search (the variants it tries, within
:class:`SearchOptions`), the set-up (the job's environment, what it reads on the unsplit module, the
stages, the optimizers, a context around each step, the gradient reductions of the optimizer step:
the values it is given and gives back are ``job.py``'s) and the planner (what one micro-batch costs a
stage, a rank's memory, a step's time, what its time needs measured on the job: ``ledgers.py``'s
``CostLedger``, ``MemoryLedger``, ``TimeLedger``, ``TimeBench``). Each member's default leaves
everything as it is, so a technique writes only what it does. No registry, no lookup by name: the
tuple is read top to bottom.

A technique reads the plan duck-typed (any of its fields: FSDP2 reads ``plan.offload`` to keep its
shards on the host), never imports another technique, ``plan/``, ``sources/``, ``strategies/`` or
Lightning; what several techniques share lives one floor below (``layout/``, ``optim/``, ``grads/``).
It sees this rank's stages through the stage view (``pipeline/stage_source.py``: the same verbs on both
sources) and the unsplit module as an ``UnsplitModel``, never asking which source split it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_parallel.pipeline.stage_source import UnsplitModel
from lightning_parallel.techniques.job import Environment, Job, Reduction
from lightning_parallel.techniques.job import buffers_to as buffers_to  # (see below)
from lightning_parallel.techniques.ledgers import CostLedger, MemoryLedger, TimeBench, TimeLedger
from lightning_parallel.techniques.ledgers import UnitSample as UnitSample  # (see below)

# buffers_to and UnitSample live in job.py and ledgers.py; two modules being edited on other branches as
# this one split the contract (strategies/pipeline/strategy.py, planner/time_probe.py) still import them
# from here: drop these two re-exports once those imports name the new homes.


@dataclass(frozen=True)
class SearchOption:
    """One option of the planner's search that a technique declares (``Technique.search_options``) and its
    ``variants`` read (:meth:`SearchOptions.asks`): a keyword of ``Search`` and, unless ``flag`` is None,
    a flag of ``python -m lightning_parallel.planner``, both made from this declaration alone.

    Args:
        name: the keyword (``Search(name=...)``) and the flag's destination.
        default: its value when not given.
        help: the flag's help line.
        flag: the flag (``""``: ``--`` and the name with dashes; None: a keyword only).
        choices: the flag's words and the value each stands for (the default's word is the flag's
            default); None: a bool ``default`` makes the flag a switch to ``not default``, anything else
            a flag that takes one value (``type`` of its text).
        type: what the flag's text becomes (``str``: as given).
        suggest: what the planner's advice calls the search with this option at its default, offered
            when nothing fits and the option was moved off it (``""``: never offered).

    Example::

        >>> SearchOption("offload", True, "do not try offloading to the host", flag="--no-offload").flag
        '--no-offload'
        >>> SearchOption("offload_dir", None, "...").flag
        '--offload-dir'
    """

    name: str
    default: Any = None
    help: str = ""
    flag: str | None = ""
    choices: Mapping[str, Any] | None = None
    type: Callable[[str], Any] = str
    suggest: str = ""

    def __post_init__(self) -> None:
        if self.flag == "":
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))


@dataclass(frozen=True, init=False)
class SearchOptions:
    """What the planner's search lets the techniques try (``Technique.variants``): the measured model and
    every technique's :class:`SearchOption` by name (``Search``'s, as it was given them).

    Args:
        layout: how the measured model's units are laid out (``UnitLayout.kind``: ``"sequential"``, a
            split ``nn.Sequential``; ``"blocks"``; ``"whole"``; ``""``: not said).
        model: the measured model the plans are for (the planner's ``ModelFacts``: its units' modules,
            its batch's ``tokens``), read duck-typed; None: not given (a listing without a model).
        options: the techniques' search options by name (those not given: their defaults).
        **asked: more of them by name (``SearchOptions(sequence_parallel=True)``).

    Example::

        >>> SearchOptions(layout="sequential").asks(SearchOption("offload", True))
        True
    """

    layout: str = ""
    model: Any = field(default=None, compare=False)
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __init__(
        self, layout: str = "", model: Any = None, options: Mapping[str, Any] | None = None, **asked: Any
    ) -> None:
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "options", {**(options or {}), **asked})

    def asks(self, option: SearchOption) -> Any:
        """The value the search gives ``option`` (its default where not given)."""
        return self.options.get(option.name, option.default)


class Technique:
    """One technique. Every member is optional: the defaults leave everything as it is.

    ``name``: how the technique is called (``"offload"``). ``fields``: the ``ParallelPlan`` fields it owns
    (documented in ``ParallelPlan``); ``searched``: those of them the planner's search decides (a
    ``plan="auto"`` is not given them); ``search_options``: what its ``variants`` let the user narrow or
    widen (:class:`SearchOption`: each a ``Search`` keyword and a planner flag, read back with
    ``search.asks(option)``).

    Example::

        class Offload(Technique):
            name, fields = "offload", ("offload", "offload_pin_memory")

            def label(self, plan):
                return " +offload opt" if plan.offload else ""

        TECHNIQUE = Offload()
    """

    name: str = ""
    fields: tuple[str, ...] = ()
    searched: tuple[str, ...] = ()
    search_options: tuple[SearchOption, ...] = ()

    # --- the plan (plan/parallel_plan.py folds these in __post_init__, in the list's order)
    def normalized(self, plan: Any) -> dict[str, Any]:
        """Its fields' canonical values (a list as a tuple, ...); a TypeError or ValueError for a bad one."""
        return {}

    def check(self, plan: Any) -> None:
        """Refuse what cannot go together, with the value and the fix (ValueError/TypeError)."""

    def label(self, plan: Any) -> str:
        """Its part of the plan's short name (``" +offload opt"``, a leading space), ``""`` when off."""
        return ""

    def variants(self, plan: Any, search: SearchOptions) -> Iterable[dict[str, Any]]:
        """The option dicts the search tries on top of ``plan`` (``{}``: as it is); the plan's own checks
        reject what cannot combine."""
        yield {}

    # --- the job (strategies/pipeline/setup.py and strategy.py fold these)
    def batch(self, plan: Any, mesh: Any, module: nn.Module) -> Callable[[Any], Any] | None:
        """A transform of every batch this rank's steps get (training, evaluation, prediction) and of the
        first input the sources split at, before anything reads it (micro-batches, item counts, the
        user's step); None: the batch as it comes. Made once per job, before the split, on every rank
        (sequence parallelism: this rank's shard of each sequence). It may hook the module's calls that
        the batch's shape decides (``position_ids``)."""
        return None

    def call_keywords(self, plan: Any, mesh: Any, module: nn.Module) -> Callable[[str, dict], dict] | None:
        """A transform ``(path, kwargs) -> kwargs`` of the keywords the user's step passes the pipelined
        call (``path``: the called module's in ``module``; a Hugging Face model's ``labels=``), applied
        where the call is captured (the first input the sources split at, then every step that feeds or
        counts it), before they are bound; None: as they come. Made once per job, with :meth:`batch`,
        on every rank; it may run collectives of a group whose ranks all capture alike (sequence
        parallelism: the next shard's first label)."""
        return None

    def item_count(self, plan: Any, mesh: Any, count: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """The user's item count (``TokenWeightedLoss(count=...)``) as this rank's steps apply it: to each
        micro-batch of the batch after :meth:`batch`, where it must count what that rank's loss averages
        over (sequence parallelism: a shifted count of the shard's labels takes the next shard's first
        label). ``count`` as it is by default; made once per job, on every rank; it may run collectives
        of a group whose ranks all count alike."""
        return count

    def environment(self, plan: Any, env: Environment) -> None:
        """What the job needs before its process group exists (``env.host_backend = ...``); refusals
        the device decides (a ValueError with the fix)."""

    def before_split(self, plan: Any, model: UnsplitModel) -> Any:
        """What it reads on the unsplit module, on every rank alike (kept as ``job.before_split[name]``;
        None: nothing); refusals of what the source's stages cannot take (a ValueError with the fix)."""
        return None

    def stages(self, view: Any, job: Job) -> str | None:
        """Transform this rank's stages (through the stage view's methods); a line for the log, or None."""
        return None

    def optimizers(self, optimizers: list[torch.optim.Optimizer], job: Job) -> list[torch.optim.Optimizer]:
        """The optimizers as the technique wraps or rebuilds them (right after ``configure_optimizers``)."""
        return optimizers

    def teardown(self, optimizers: list[torch.optim.Optimizer], job: Job, interrupted: bool = False) -> None:
        """Release what its optimizers hold outside the process's memory (files, threads) when the run
        ends: normally, by a stop, or by an error (the strategy's teardown). ``interrupted``: by a stop
        or an error; else normally, and a checkpoint may still be saved from the optimizers (Lightning's
        ``on_fit_end``, ``trainer.save_checkpoint`` after ``fit``): keep what their ``state_dict()`` needs."""

    def step_context(self, job: Job) -> AbstractContextManager[Any] | None:
        """A context entered around each schedule step (reused step after step), or None: the runner's
        only contexts. Training steps and forward-only ones (evaluation, under no_grad) alike."""
        return None

    def reductions(self, job: Job) -> list[Reduction]:
        """The gradient reductions the optimizer step's sync runs for this technique."""
        return []

    def predictions(self, output: Any, batch: Any, mesh: Any) -> Any:
        """A prediction step's output (``batch``: the step's batch, as this rank got it) as the technique
        transforms it before the replicas' predictions are collected; every rank calls it, in the list's
        order, so it may be a collective of the technique's group (sequence parallelism: the shards'
        predictions joined). The default returns it unchanged."""
        return output

    # --- the planner (planner/stage_costs.py, planner/estimate.py, planner/time_model.py fold these)
    def stage_costs(self, ledger: CostLedger) -> None:
        """Change what one micro-batch costs each stage (``ledger.stages``), before any rank's columns:
        what both the memory estimate and the time model start from."""

    def memory(self, ledger: MemoryLedger) -> None:
        """Move one rank's bytes between the ledger's device, host and disk columns (before the walk of
        the schedule; see :class:`MemoryLedger` for the phases and the order)."""

    def measure(self, bench: TimeBench) -> Any:
        """Time on the job what its ``time`` needs measured in place (every rank calls it; collectives are
        allowed); what it returns, ``time`` reads as ``ledger.times.measured[self.name]``. ``None``:
        nothing measured (``time`` then models its effect from the links). An error on any rank leaves
        the measurement out on every rank."""
        return None

    def time(self, ledger: TimeLedger) -> None:
        """Add seconds to one rank's stages, start or tail (see :class:`TimeLedger`)."""
