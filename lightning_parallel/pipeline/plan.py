"""StagePlan: what each pipeline stage holds and which ranks run it; prints the stage table (with the
bytes of the fullest FSDP2 shard each rank of a sharded stage keeps)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_parallel._table import format_bytes, format_table
from lightning_parallel.layout.ranks import RankLayout


@dataclass(frozen=True)
class StageSpec:
    """One stage: the units it runs, the parameters they use, and the ranks that hold it.

    ``units`` are the nn.Sequential's child names on the Sequential path, or the module paths the
    stage's part of ``forward`` calls on the traced path (``"h.2"``). ``parameters`` are canonical
    parameter names (the unsplit module's ``named_parameters()``), so a tied weight has one name.
    ``bytes_per_rank``: with FSDP2 shards, the parameter bytes each of the stage's ranks keeps (the
    fullest shard: whole rows of dim 0), in the module's dtype.
    """

    index: int
    units: tuple[str, ...]
    holds: str
    num_parameters: int
    ranks: tuple[int, ...]
    cost: float | None = None
    parameters: frozenset[str] = field(default_factory=frozenset)
    bytes_per_rank: int | None = None


@dataclass(frozen=True)
class StagePlan:
    """The whole pipeline layout, the same on every rank.

    With ``stages_per_rank`` > 1 the stages loop over the pipeline ranks: stage ``s`` runs on
    pipeline rank ``s % pp_size`` (the order of torch's interleaved and looped schedules), or, with
    ``style="v"`` (ZBV, DualPipeV), rank ``r`` holds stages ``r`` and ``2p-1-r``.

    Example::

        plan = make_plan([("0",), ("1", "2")], ["0  (Linear)", "1-2  (Linearx2)"], [10, 20],
                         RankLayout(pp_size=2, dp_size=1))
        print(plan.format_table())
    """

    stages: tuple[StageSpec, ...]
    layout: RankLayout
    cost_unit: str = ""
    source: str = "the pipelined module"
    notes: tuple[str, ...] = ()
    shared_sizes: tuple[tuple[str, int], ...] = ()  # (canonical name, elements) of tied parameters
    style: str = "loop"  # stage placement: "loop" or "v" (see stage_rank)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.layout.pp_size

    def pp_rank_of(self, stage_index: int) -> int:
        return stage_rank(stage_index, self.layout.pp_size, self.num_stages, self.style)

    def local_stages(self, pp_rank: int) -> list[StageSpec]:
        return [s for s in self.stages if self.pp_rank_of(s.index) == pp_rank]

    def format_table(self) -> str:
        """The stage table printed by global rank 0 at start."""
        layout = self.layout
        headers = ["stage", "ranks", "holds", "parameters"]
        sharded = any(s.bytes_per_rank is not None for s in self.stages)
        if sharded:
            headers.append(f"per rank (1/{layout.dp_shard_size} shard)")
        has_cost = any(s.cost is not None for s in self.stages)
        if has_cost:
            headers.append(f"cost{f' ({self.cost_unit})' if self.cost_unit else ''}")
        rows = []
        for s in self.stages:
            row = [str(s.index), ",".join(map(str, s.ranks)), s.holds, f"{s.num_parameters:,}"]
            if sharded:
                row.append("" if s.bytes_per_rank is None else format_bytes(s.bytes_per_rank))
            if has_cost:
                row.append("" if s.cost is None else f"{s.cost:.3g}")
            rows.append(row)
        tp = f" x {layout.tp_size} tensor-parallel ranks" if layout.tp_size > 1 else ""
        if layout.dp_shard_size > 1:
            replicas = layout.dp_replicate_size
            hybrid = f", the shards replicated {replicas} times (HSDP)" if replicas > 1 else ""
            data = (f"{layout.dp_size} data-parallel ranks, each stage sharded over {layout.dp_shard_size} "
                    f"of them (FSDP2){hybrid}")  # fmt: skip
        else:
            data = f"{layout.dp_size} data-parallel replicas"
        lines = [
            format_table(headers, rows),
            f"{self.num_stages} stages on {layout.pp_size} pipeline ranks x {data}{tp}; "
            f"{self.total_parameters():,} parameters in {self.source}",
            *(["V placement: pipeline rank r holds stages r and 2p-1-r"] if self.style == "v" else []),
            *self.notes,
        ]
        return "\n".join(lines)

    def total_parameters(self) -> int:
        """Parameters of the whole model: a tied weight, held by several stages, counts once."""
        counts = Counter(n for s in self.stages for n in s.parameters)
        excess = sum(size * (counts[name] - 1) for name, size in self.shared_sizes if counts[name] > 1)
        return sum(s.num_parameters for s in self.stages) - excess


def make_plan(
    stage_units: Sequence[Sequence[str]],
    holds: Sequence[str],
    num_parameters: Sequence[int],
    layout: RankLayout,
    costs: Sequence[float] | None = None,
    cost_unit: str = "",
    source: str = "the pipelined module",
    stage_parameters: Sequence[frozenset[str]] | None = None,
    shared_sizes: Mapping[str, int] | None = None,
    notes: Sequence[str] = (),
    bytes_per_rank: Sequence[int] | None = None,
    style: str = "loop",
) -> StagePlan:
    """Build the plan from what each stage runs; stage ``s`` goes to pipeline rank ``stage_rank(s, ...)``.

    ``bytes_per_rank``: per stage, the parameter bytes each rank keeps when the stages are sharded.
    """
    if len(stage_units) % layout.pp_size:
        raise ValueError(f"{len(stage_units)} stages do not loop evenly over {layout.pp_size} pipeline ranks")
    num_stages = len(stage_units)
    stages = tuple(
        StageSpec(
            index=index,
            units=tuple(units),
            holds=holds[index],
            num_parameters=int(num_parameters[index]),
            ranks=layout.replicas_of(stage_rank(index, layout.pp_size, num_stages, style)),
            cost=None if costs is None else float(costs[index]),
            parameters=frozenset(stage_parameters[index]) if stage_parameters else frozenset(),
            bytes_per_rank=None if bytes_per_rank is None else int(bytes_per_rank[index]),
        )
        for index, units in enumerate(stage_units)
    )
    shared = tuple(sorted((shared_sizes or {}).items()))
    return StagePlan(stages, layout, cost_unit, source, tuple(notes), shared, style)


def stage_rank(stage_index: int, pp_size: int, num_stages: int, style: str = "loop") -> int:
    """The pipeline rank of a stage: ``"loop"`` (``s % p``) or ``"v"`` (rank r: stages r and 2p-1-r).

    The same mapping as torch's ``generate_stage_to_rank_mapping`` (which the schedules use to address
    their sends), written here so the plan needs no schedule.

    Example::

        >>> [stage_rank(s, 2, 4, "v") for s in range(4)], [stage_rank(s, 2, 4) for s in range(4)]
        ([0, 1, 1, 0], [0, 1, 0, 1])
    """
    if style == "loop":
        return stage_index % pp_size
    if style != "v" or num_stages % pp_size:
        raise ValueError(f"no {style!r} placement of {num_stages} stages on {pp_size} ranks")
    lap, pos = divmod(stage_index, pp_size)
    return pos if lap % 2 == 0 else pp_size - 1 - pos


def describe_layers(names: Sequence[str], types: Sequence[str]) -> str:
    """``"1-3  (Blockx2, Linear)"``: a run of a Sequential's children and their classes."""
    span = names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"
    counts = Counter(types)
    return f"{span}  (" + ", ".join(f"{t}x{n}" if n > 1 else t for t, n in counts.items()) + ")"


def describe_paths(paths: Sequence[str]) -> str:
    """``"wte, wpe, h.0-1"``: module paths in call order, runs of numbered siblings collapsed."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (parent, first index, last index)
    for path in paths:
        match = re.fullmatch(r"(.*)\.(\d+)", path)
        if match and run and run[0] == match[1] and int(match[2]) == run[2] + 1:
            run = (run[0], run[1], int(match[2]))
            continue
        if run:
            out.append(_run_text(run))
            run = None
        if match:
            run = (match[1], int(match[2]), int(match[2]))
        else:
            out.append(path)
    if run:
        out.append(_run_text(run))
    return ", ".join(out)


def _run_text(run: tuple[str, int, int]) -> str:
    parent, first, last = run
    return f"{parent}.{first}" if first == last else f"{parent}.{first}-{last}"


def shard_rows(rows: int, shards: int) -> int:
    """Rows of dim 0 on the fullest of ``shards`` FSDP2 shards (FSDP2 pads to equal whole rows).

    Example::

        >>> shard_rows(13, 2)
        7
    """
    return -(-rows // shards)


def shard_bytes(shape: Sequence[int], element_size: int, shards: int) -> int:
    """Bytes of the fullest of ``shards`` FSDP2 shards of a tensor: whole rows of dim 0, rounded up.

    Example::

        >>> shard_bytes((13, 8), 4, 2)   # 7 of the 13 rows
        224
    """
    if not shape:
        return element_size
    per_row = element_size
    for d in shape[1:]:
        per_row *= d
    return shard_rows(shape[0], shards) * per_row
