"""StagePlan: which layers each pipeline stage holds and which ranks run it; prints the stage table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_parallel._table import format_table


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: a contiguous run of the Sequential's children and the ranks that hold it."""

    index: int
    layer_names: tuple[str, ...]
    layer_types: tuple[str, ...]
    num_parameters: int
    ranks: tuple[int, ...]
    cost: float | None = None


@dataclass(frozen=True)
class StagePlan:
    """The whole pipeline layout, the same on every rank.

    Ranks are laid out pipeline-outermost (as torchtitan does): global rank = ``pp_rank * dp_size +
    dp_rank``, so the replicas of one stage are neighbours (their gradient all-reduce is the heavy
    traffic) and global rank 0 holds stage 0 of replica 0. With ``stages_per_rank`` > 1 the stages
    loop over the pipeline ranks: stage ``s`` runs on pipeline rank ``s % pp_size``.

    Example::

        plan = make_plan(["0", "1", "2", "3"], ["Linear"] * 4, [10, 10, 10, 10], [2, 2], pp_size=2, dp_size=1)
        print(plan.format_table())
    """

    stages: tuple[StageSpec, ...]
    pp_size: int
    dp_size: int
    cost_unit: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp_size

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp_size + dp_rank

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a global rank."""
        return divmod(global_rank, self.dp_size)

    def local_stages(self, pp_rank: int) -> list[StageSpec]:
        return [s for s in self.stages if s.index % self.pp_size == pp_rank]

    def format_table(self) -> str:
        """The stage table printed by global rank 0 at start."""
        headers = ["stage", "ranks", "layers", "parameters"]
        has_cost = any(s.cost is not None for s in self.stages)
        if has_cost:
            headers.append(f"cost{f' ({self.cost_unit})' if self.cost_unit else ''}")
        rows = []
        for s in self.stages:
            row = [
                str(s.index),
                ",".join(map(str, s.ranks)),
                f"{_span(s.layer_names)}  {_summarise(s.layer_types)}",
                f"{s.num_parameters:,}",
            ]
            if has_cost:
                row.append("" if s.cost is None else f"{s.cost:.3g}")
            rows.append(row)
        total = sum(s.num_parameters for s in self.stages)
        out = [format_table(headers, rows)]
        out.append(
            f"{self.num_stages} stages on {self.pp_size} pipeline ranks x {self.dp_size} data-parallel "
            f"replicas; {total:,} parameters in the pipelined Sequential"
        )
        return "\n".join(out)


def make_plan(
    layer_names: Sequence[str],
    layer_types: Sequence[str],
    layer_params: Sequence[int],
    counts: Sequence[int],
    pp_size: int,
    dp_size: int,
    costs: Sequence[float] | None = None,
    cost_unit: str = "",
) -> StagePlan:
    """Build the plan from per-layer facts and the number of layers per (virtual) stage."""
    if len(counts) % pp_size:
        raise ValueError(f"{len(counts)} stages do not loop evenly over {pp_size} pipeline ranks")
    stages, start = [], 0
    for index, count in enumerate(counts):
        span = slice(start, start + count)
        pp_rank = index % pp_size
        stages.append(
            StageSpec(
                index=index,
                layer_names=tuple(layer_names[span]),
                layer_types=tuple(layer_types[span]),
                num_parameters=int(sum(layer_params[span])),
                ranks=tuple(pp_rank * dp_size + d for d in range(dp_size)),
                cost=None if costs is None else float(sum(costs[span])),
            )
        )
        start += count
    return StagePlan(tuple(stages), pp_size, dp_size, cost_unit)


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"


def _summarise(types: Sequence[str]) -> str:
    counts = Counter(types)
    parts = [f"{t}x{n}" if n > 1 else t for t, n in counts.items()]
    return "(" + ", ".join(parts) + ")"
