"""Activation checkpointing of a stage's units: recompute each selected unit's forward in backward.

The technique (:data:`TECHNIQUE`, ``activation_checkpointing=``): its setting checked, its label, its
variant in the search, and its transform of this rank's stages (:func:`apply`, now or as each is
prepared); for the planner, what a stage keeps per micro-batch with the selected units recomputed
(:func:`memory`, :meth:`Recompute.stage_costs`) and the forwards run again in backward
(:meth:`Recompute.time`, measured in place under ``plan="auto"``: ``timing.py``).

A *unit* is a named submodule a stage calls: a layer of the split ``nn.Sequential`` (``"layers.3"``)
or a block the traced stage graph calls (``"h.2"``). Wrapping replaces the unit's ``forward`` on
the instance only, so parameter names, ``state_dict`` keys and hooks are untouched, and
:func:`remove_activation_checkpointing` restores it. Recomputation uses torch's non-reentrant
``torch.utils.checkpoint`` (it works with ``torch.autograd.grad``, which the pipeline stages call,
and restores the RNG state, so dropout draws the same mask twice).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource, UnitNaming
from lightning_parallel.techniques.contract import SearchOptions, Technique
from lightning_parallel.techniques.job import Job
from lightning_parallel.techniques.ledgers import CostLedger, TimeBench, TimeLedger
from lightning_parallel.techniques.recompute.timing import RecomputeTimes, measure_recompute

Units = Sequence[tuple[str, nn.Module]]

Selection = bool | Callable[[str, nn.Module], bool] | Sequence[str]
"""Which units recompute: ``True`` (all), ``False``, a list of unit names or ``(name, module) -> bool``."""


class Recompute(Technique):
    """Recomputation (``activation_checkpointing=``): the selected units' forward again in backward.

    Example::

        ParallelPlan(activation_checkpointing=["h.1"]).activation_checkpointing   # ('h.1',)
    """

    name, fields, searched = "recompute", ("activation_checkpointing",), ("activation_checkpointing",)

    def normalized(self, plan: Any) -> dict[str, Any]:
        select = plan.activation_checkpointing
        check_selection(select)
        return {"activation_checkpointing": tuple(select)} if isinstance(select, list) else {}

    def label(self, plan: Any) -> str:
        return " +ac" if plan.activation_checkpointing else ""

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        yield {}
        if plan.activation_checkpointing is False:
            yield {"activation_checkpointing": True}

    def stages(self, view: Any, job: Job) -> str | None:
        if job.plan.activation_checkpointing is False:
            return None
        every_unit = [view.naming.prefix + u for stage in job.table.stages for u in stage.units]
        apply(view, job.plan.activation_checkpointing, every_unit)
        return None

    def stage_costs(self, ledger: CostLedger) -> None:
        """Each stage keeps, per micro-batch, only the inputs of its recomputed units (:func:`memory`); its
        backward recomputes one unit at a time (its largest recomputed unit's saves, a transient)."""
        chosen = set(recomputed_units(ledger.facts, ledger.plan.activation_checkpointing))
        if not chosen:
            return
        ledger.stages = [_recomputed(c, ledger.facts, chosen, ledger.micro_batch) for c in ledger.stages]

    def measure(self, bench: TimeBench) -> RecomputeTimes | None:
        """Checkpointing in place: the bench's block wrapped as a unit is (torch's checkpoint) against the
        same block without it (:func:`~.timing.measure_recompute`)."""
        return measure_recompute(bench, _wrap) if bench.samples else None

    def time(self, ledger: TimeLedger) -> None:
        """In backward, the forward of each recomputed unit once more; measured in place under
        ``plan="auto"`` (:class:`~.timing.RecomputeTimes`), what checkpointing adds to a forward
        and to a backward per second of plain forward instead (its hooks included)."""
        chosen = set(recomputed_units(ledger.facts, ledger.plan.activation_checkpointing))
        if not chosen:
            return
        times, mb = ledger.times, ledger.micro_batch
        measured = times.measured.get(self.name) if times is not None else None
        into_forward, into_backward = (
            measured.factors(mb) if isinstance(measured, RecomputeTimes) else (0.0, 1.0)
        )
        ledger.recomputed |= chosen
        for c in ledger.stages:
            plain = sum(times.units[n].forward.at(mb) for n in c.units if n in chosen and n in times.units)
            ledger.forward[c.index] += into_forward * plain
            ledger.backward[c.index] += into_backward * plain
            ledger.share(c.index, "recompute", (into_forward + into_backward) * plain)


TECHNIQUE = Recompute()


def check_selection(select: Any) -> None:
    """Raise a TypeError unless ``select`` is a bool, a callable or a list of names.

    Example::

        check_selection(["layers.1", "layers.2"])   # fine
    """
    if isinstance(select, bool) or callable(select):
        return
    names_ok = isinstance(select, Sequence) and all(isinstance(n, str) for n in select)
    if isinstance(select, str) or not names_ok:
        raise TypeError(
            f"activation_checkpointing must be True/False, a callable (name, module) -> bool or a list of "
            f"unit names, got {select!r}"
        )


# Marks a wrapped forward; its value is the forward the unit had before.
_ORIGINAL = "_lightning_parallel_original_forward"


def select_units(units: Units, select: Selection) -> list[str]:
    """The names of the units ``select`` chooses, in the order of ``units``.

    Args:
        units: ``(name, module)`` pairs, e.g. a stage's layers.
        select: ``True`` (all), ``False`` (none), a callable ``(name, module) -> bool``, or a list of
            unit names.

    Raises:
        ValueError: a listed name matches no unit (the message names the unknown and the available ones).
        TypeError: ``select`` is none of the above.

    Example::

        >>> layers = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> select_units(list(layers.named_children()), ["0"])
        ['0']
    """
    check_selection(select)
    names = [name for name, _ in units]
    if isinstance(select, bool):
        return list(names) if select else []
    if callable(select):
        return [name for name, module in units if select(name, module)]
    unknown = [n for n in select if n not in names]
    if unknown:
        raise ValueError(
            f"activation_checkpointing names units that do not exist: {unknown}; the units are {names}"
        )
    chosen = set(select)
    return [name for name in names if name in chosen]


def apply_activation_checkpointing(units: Units, select: Selection = True) -> list[str]:
    """Recompute the forward of each selected unit in backward instead of keeping its activations.

    Only the unit's inputs are saved; the activations inside it are recomputed when backward
    reaches it. Losses and gradients are those of the unwrapped module. Applying twice is a no-op
    for units already wrapped.

    Args:
        units: ``(name, module)`` pairs the caller owns (a stage's layers or blocks).
        select: which units: see :func:`select_units`.

    Returns:
        The names of the units wrapped (including those already wrapped), in unit order.

    Raises:
        ValueError: ``select`` lists a name that is not a unit.

    Example::

        blocks = [(f"h.{i}", block) for i, block in enumerate(model.h)]
        apply_activation_checkpointing(blocks, ["h.1", "h.2"])   # -> ["h.1", "h.2"]
        remove_activation_checkpointing(blocks)
    """
    chosen = select_units(units, select)
    modules = dict(units)
    for name in chosen:
        _wrap(modules[name])
    return chosen


def remove_activation_checkpointing(units: Units) -> list[str]:
    """Restore the original forward of every wrapped unit; returns the names restored.

    Example::

        remove_activation_checkpointing(list(stage.named_children()))
    """
    restored = []
    for name, module in units:
        if is_checkpointed(module):
            original = module.__dict__.pop(_ORIGINAL)
            if original is None:
                del module.forward  # the class's forward shows through again
            else:
                module.forward = original
            restored.append(name)
    return restored


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped this module's forward.

    Example::

        assert is_checkpointed(model.h[1])
    """
    return _ORIGINAL in module.__dict__


def _wrap(module: nn.Module) -> None:
    if is_checkpointed(module):
        return
    # An instance-level forward (set by the user or another wrapper) is kept and restored as is.
    module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
    # A bound method, not a closure: a deep copy of the module then recomputes its own forward.
    module.forward = types.MethodType(_recomputed_forward, module)


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    original = self.__dict__[_ORIGINAL]
    forward = original if original is not None else functools.partial(type(self).forward, self)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def local_selection(select: Selection, naming: UnitNaming, units: Units) -> Selection:
    """The part of ``select`` that names ``units`` (already named), ``True`` narrowed to the blocks."""
    if select is True and naming.blocks:
        return [n for n, _ in units if n.startswith(naming.blocks)]
    if isinstance(select, bool) or callable(select):
        return select
    here = {n for n, _ in units}
    return [n for n in select if n in here]


def apply(stages: StageSource, select: Selection, every_unit: Sequence[str]) -> None:
    """Recompute the selected units of each of this rank's stages (the stage view's ``each_stage``: now,
    or as each stage is prepared). ``every_unit``: the names of every stage's units, so an unknown name
    raises the same error on every rank (the plan is the same everywhere).

    Example::

        recompute.apply(runner.stages, ["h.1"], ["h.0", "h.1", "lm_head"])
    """
    naming = stages.naming
    if select is False:
        return
    if not callable(select) and not isinstance(select, bool):
        unknown = [n for n in select if n not in every_unit]
        if unknown:
            raise ValueError(
                f"activation_checkpointing names units that do not exist: {unknown}; the units are "
                f"{list(every_unit)}"
            )

    def wrap(stage: PreparedStage) -> None:
        apply_activation_checkpointing(stage.units, local_selection(select, naming, stage.units))

    stages.each_stage(wrap)


def recomputed_units(facts: Any, select: Selection) -> list[str]:
    """The units of the planner's measured model (``facts.layout``) that ``select`` recomputes, as the
    strategy selects them (:func:`selected`; ``True``: the blocks of a model with blocks).

    Raises:
        ValueError: ``select`` names a unit the model does not have.
    """
    if select is False:
        return []
    units = [(u.name, u.module) for u in facts.layout.units]
    blocks = [(u.name, u.module) for u in facts.layout.blocks()] if facts.layout.kind == "blocks" else units
    return selected(units, blocks, select)


def _recomputed(stage: Any, facts: Any, chosen: set[str], mb: float) -> Any:
    """A stage's costs (``StageCosts``) with the ``chosen`` units recomputed, from the measured units."""
    units = [_unit_bytes(name, facts.probe.unit(name), mb) for name in stage.units]
    plain, held = memory(units, set(), stage.index == 0), memory(units, chosen, stage.index == 0)
    return dataclasses.replace(
        stage,
        per_microbatch=stage.per_microbatch - plain.kept + held.kept,
        backward_transient=stage.backward_transient + held.peak,
    )


def _unit_bytes(name: str, a: Any, mb: float) -> UnitBytes:
    """One measured unit (the probe's ``UnitActivations``) at ``mb`` samples."""
    return UnitBytes(
        name, a.saved.at(mb), a.inputs.at(mb), a.saved_input.at(mb), a.saved_output.at(mb), a.after.at(mb)
    )


@dataclass(frozen=True)
class UnitBytes:
    """One unit's bytes for one micro-batch, as the planner measured them (see ``planner/probe.py``)."""

    name: str
    saved: int  # saved for backward
    inputs: int
    saved_input: int  # of ``saved``: the unit's own inputs
    saved_output: int  # of ``saved``: the unit's own outputs
    after: int  # what the code after the unit saves (a residual add): never recomputed


@dataclass(frozen=True)
class RecomputedBytes:
    """What recomputation does to a stage: bytes kept per micro-batch in flight, and the extra peak of
    recomputing its largest recomputed unit during backward (one unit at a time)."""

    kept: int
    peak: int
    recomputed_saves: int  # what the recomputed units saved: their forward runs twice (the time model's)


def memory(units: Sequence[UnitBytes], recomputed: set[str], first: bool) -> RecomputedBytes:
    """What a stage keeps per micro-batch until its backward, with the ``recomputed`` units checkpointed.

    A recomputed unit keeps only its inputs (none on a later stage's first unit: the receive buffer holds
    them; not twice where the unit before saved its output); the unit after a recomputed one saves the
    input that unit no longer saves. ``first``: the first stage (its input is no receive buffer).

    Example::

        >>> unit = UnitBytes("h.0", saved=100, inputs=10, saved_input=10, saved_output=0, after=0)
        >>> memory([unit], set(), first=True).kept, memory([unit], {"h.0"}, first=True).kept
        (100, 10)
    """
    total = 0
    for i, unit in enumerate(units):
        before = units[i - 1] if i > 0 else None
        if unit.name in recomputed:
            kept = unit.inputs  # the checkpoint keeps the unit's inputs alive
            if i == 0 and not first:
                kept = 0  # the receive buffer already holds them
            elif before is not None and before.name not in recomputed:
                kept -= min(kept, before.saved_output)
        else:
            kept = unit.saved
            if i == 0 and not first:
                kept -= unit.saved_input  # saved input = the receive buffer
            elif before is not None and before.name in recomputed:
                kept += before.saved_output  # the input the recomputed unit no longer saves
        total += kept + unit.after
    saves = [u.saved for u in units if u.name in recomputed]
    return RecomputedBytes(total, max(saves, default=0), sum(saves))


def selected(units: Units, blocks: Units, select: Selection) -> list[str]:
    """The units ``select`` recomputes: ``True`` means the ``blocks`` (a GPT's, not its embeddings or
    head), else as :func:`select_units` chooses among ``units``.

    Example::

        >>> layers = list(nn.Sequential(nn.Linear(2, 2), nn.ReLU()).named_children())
        >>> selected(layers, layers, True)
        ['0', '1']
    """
    if isinstance(select, tuple):
        select = list(select)
    return select_units(blocks if select is True else units, select)
