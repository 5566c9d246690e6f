"""The pipeline units of a module: what a pipeline stage holds, found by the splits' own finders.

Two shapes can be split, as ``PipelineStrategy`` recognises them:

- **a top-level ``nn.Sequential``** (the Sequential path's ``find_sequential``; or the module itself is
  one): its layers are the units, named by their path (``"layers.3"``);
- **a GPT-shaped module** (the traced path's ``find_block_list``): the block list holding most
  parameters (an ``nn.ModuleList``, a nested ``nn.Sequential`` or a numbered ``nn.ModuleDict``) gives the
  blocks (``"h.0"``, ``"h.1"``, ...); the modules called before the first block (embeddings) go to stage
  0, those called after the last block (final norm, head) to the last stage. A weight tied between
  them (embedding and head) is held by both stages.

A module of neither shape cannot be split, but ``PipelineStrategy(pipeline_size=1)`` still runs it
whole on each rank (replicas, ZeRO-1, offload: its traced path needs no blocks for one stage): its
top-level children are then its units (``kind="whole"``), all on the one stage.

Call order comes from forward hooks during the probe forward (:mod:`lightning_parallel.planner.probe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_parallel.pipeline.blocks import find_block_list
from lightning_parallel.pipeline.partition import check_explicit, partition_balanced, partition_uniform
from lightning_parallel.sources.sequential.split import check_parameters_inside, find_sequential

PRE, BLOCK, POST = "pre", "block", "post"
WHOLE = "whole"
NOT_SPLIT = "no top-level nn.Sequential holding every parameter, no nn.ModuleList of blocks"


@dataclass
class Unit:
    """One named submodule a stage runs: a block (partitioned) or an extra of the first/last stage."""

    name: str
    module: nn.Module
    role: str = BLOCK


@dataclass
class UnitLayout:
    """The units of a module in call order and the parameters none of them owns (held by stage 0).

    Example::

        layout = find_units(model)            # before the probe: blocks only, extras unordered
        layout.blocks()                        # the units a partition spreads over the stages
    """

    kind: str  # "sequential", "blocks", or "whole" (no split: the top-level children, one stage)
    container: str
    units: list[Unit]
    loose: list[nn.Parameter] = field(default_factory=list)

    def blocks(self) -> list[Unit]:
        return [u for u in self.units if u.role == BLOCK]

    @property
    def max_stages(self) -> int:
        """The most stages the module can be cut into: its blocks, or 1 for a module run whole."""
        return 1 if self.kind == WHOLE else len(self.blocks())

    def describe(self) -> str:
        """``"4 pipeline units (blocks `h`)"``, or what a module run whole is."""
        if self.kind == WHOLE:
            return f"no pipeline units ({NOT_SPLIT}): pipeline_size=1 plans only"
        return f"{len(self.blocks())} pipeline units ({self.kind} `{self.container}`)"

    def stage_units(self, counts: Sequence[int]) -> list[list[Unit]]:
        """The units of each stage for ``counts`` blocks per stage (extras on the first/last stage)."""
        blocks, out, start = self.blocks(), [], 0
        for c in counts:
            out.append(blocks[start : start + c])
            start += c
        out[0] = [u for u in self.units if u.role == PRE] + out[0]
        out[-1] = out[-1] + [u for u in self.units if u.role == POST]
        return out


def find_units(module: nn.Module, module_name: str | None = None) -> UnitLayout:
    """The pipeline units of ``module`` (extras of a GPT-shaped one are ordered by :func:`order_extras`);
    a module of neither shape is run whole: its top-level children are its units, on one stage.

    Raises:
        ValueError: a top-level Sequential that does not hold every parameter; a module with neither a
            Sequential, nor a list of blocks, nor any submodule.

    Example::

        >>> find_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU())).kind
        'sequential'
    """
    found = ("", module) if isinstance(module, nn.Sequential) else find_sequential(module, module_name)
    if found is not None:
        name, seq = found
        if name:
            check_parameters_inside(module, name)  # (the strategy refuses such a module the same way)
        prefix = f"{name}." if name else ""
        units = [Unit(f"{prefix}{child}", layer) for child, layer in seq.named_children()]
        return UnitLayout("sequential", name, units)
    try:
        name, children = find_block_list(module)
    except ValueError:
        return _whole(module)
    blocks = module.get_submodule(name)
    units = [Unit(f"{name}.{child}", blocks.get_submodule(child)) for child in children]
    extras = [Unit(n, m, role="") for n, m in _side_modules(module, name)]
    owned = {id(p) for u in units + extras for p in u.module.parameters()}
    loose = [p for p in module.parameters() if id(p) not in owned]
    return UnitLayout("blocks", name, extras + units, loose)


def _whole(module: nn.Module) -> UnitLayout:
    """A module no pipeline can split, run on one stage: its top-level children are the units."""
    units = [Unit(n, m) for n, m in module.named_children()]
    if not units:
        raise ValueError(
            f"{type(module).__name__} has no pipeline units: put its layers in one top-level nn.Sequential "
            f"(every parameter inside it), or its repeated blocks in an nn.ModuleList (GPT-style)"
        )
    owned = {id(p) for u in units for p in u.module.parameters()}
    return UnitLayout(WHOLE, "", units, [p for p in module.parameters() if id(p) not in owned])


def order_extras(layout: UnitLayout, first_call: dict[str, int]) -> None:
    """Mark each extra as called before the first block (``pre``) or after the last one (``post``).

    ``first_call`` maps unit names to the position of their first forward call; extras never called
    hold parameters only and go to stage 0.
    """
    blocks = layout.blocks()
    if not blocks:
        return
    first_block = min(first_call.get(u.name, 1 << 30) for u in blocks)
    for unit in layout.units:
        if unit.role == BLOCK:
            continue
        unit.role = POST if first_call.get(unit.name, -1) > first_block else PRE
    position = {u.name: first_call.get(u.name, -1) for u in layout.units}
    layout.units.sort(key=lambda u: ({PRE: 0, BLOCK: 1, POST: 2}[u.role], position[u.name]))


def partition(layout: UnitLayout, num_stages: int, method: str | Sequence[int] = "uniform") -> list[int]:
    """Blocks per stage as PipelineStrategy splits them (``"time"`` is approximated by parameters).

    Raises:
        ValueError: more stages than blocks, or an explicit list that does not fit.

    Example::

        partition(layout, 2, "parameters")   # e.g. [4, 4]
    """
    blocks = layout.blocks()
    if not isinstance(method, str):
        return check_explicit(method, len(blocks), num_stages)
    if method == "uniform":
        return partition_uniform(len(blocks), num_stages)
    costs = [float(sum(p.numel() for p in u.module.parameters())) for u in blocks]
    return partition_balanced(costs, num_stages)


def _side_modules(module: nn.Module, list_name: str) -> list[tuple[str, nn.Module]]:
    """Children of the ModuleList's ancestors that are not on the path to it (embeddings, head, ...)."""
    path = list_name.split(".")
    out, parent, prefix = [], module, ""
    for step in path:
        for child_name, child in parent.named_children():
            if child_name != step:
                out.append((f"{prefix}{child_name}", child))
        parent, prefix = getattr(parent, step), f"{prefix}{step}."
    return out
