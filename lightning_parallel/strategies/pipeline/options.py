"""PipelineStrategy's options mapped onto one :class:`~lightning_parallel.plan.parallel_plan.ParallelPlan`.

The one place where the strategy's keyword arguments become the plan: its older spellings
(``num_stages``, ``shard_optimizer_state``) are translated here, and its docstring's description of
each plan option is the plan's own (written once, in ``ParallelPlan``).
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

from lightning_parallel.plan.parallel_plan import TRAINER_FIELDS, ParallelPlan

PLAN_OPTIONS = tuple(f.name for f in fields(ParallelPlan) if f.name not in TRAINER_FIELDS)
"""The strategy's options that are fields of its plan (the Trainer decides the others)."""

OLDER_NAMES = ("num_stages", "shard_optimizer_state")


def plan_from_options(options: dict[str, Any]) -> ParallelPlan:
    """The strategy's plan from its keyword arguments (``PLAN_OPTIONS`` and the older names).

    Example::

        >>> plan_from_options({"pipeline_size": 2, "shard_optimizer_state": True}).data_parallel
        'zero1'
    """
    options = dict(options)
    options["pipeline_size"] = renamed_num_stages(
        options.get("pipeline_size"), options.pop("num_stages", None)
    )
    options["data_parallel"] = older_data_parallel(
        options.get("data_parallel"), options.pop("shard_optimizer_state", False)
    )
    return ParallelPlan("pipeline", **options)


def renamed_num_stages(pipeline_size: int | None, num_stages: int | None) -> int | None:
    if num_stages is None:
        return pipeline_size
    if pipeline_size is not None:
        raise ValueError(
            f"pass pipeline_size only (got pipeline_size={pipeline_size} and its old name "
            f"num_stages={num_stages})"
        )
    rank_zero_deprecation(
        "PipelineStrategy(num_stages=...) is deprecated: it counts pipeline ranks, so it is now called "
        f"pipeline_size. Use PipelineStrategy(pipeline_size={num_stages}) (the model is cut into "
        "pipeline_size x stages_per_rank stages)"
    )
    return num_stages


def older_data_parallel(data_parallel: str | None, shard_optimizer_state: Any) -> str:
    """``data_parallel``, or ``"zero1"`` from the older ``shard_optimizer_state=True``."""
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(f"shard_optimizer_state must be True or False, got {shard_optimizer_state!r}")
    if data_parallel is None:
        return "zero1" if shard_optimizer_state else "replicate"
    if shard_optimizer_state and data_parallel != "zero1":
        raise ValueError(
            f"shard_optimizer_state=True is data_parallel='zero1', but data_parallel={data_parallel!r} was "
            f"also given: pass only one of them"
        )
    return data_parallel


def plan_argument_docs(names: tuple[str, ...] = PLAN_OPTIONS, indent: int = 8) -> str:
    """The ``Args:`` entries of ``ParallelPlan``'s docstring for ``names``, re-indented for another one."""
    doc = ParallelPlan.__doc__ or ""
    body = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n(?=        \w+:)", body)
    chosen = [e for e in entries if e.strip().split(":", 1)[0] in names]
    pad = " " * (indent - 8)
    return "\n".join(pad + line if line else line for e in chosen for line in e.split("\n"))
