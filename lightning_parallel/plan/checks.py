"""The plan's own settings (not a technique's) checked one by one, with the value and the fix in each error.

:class:`~lightning_parallel.plan.parallel_plan.ParallelPlan` calls these once, when it is made; what
depends on several settings together (sizes against the devices) is checked there, and each technique
checks its own settings (``Technique.normalized`` and ``Technique.check``, in ``techniques/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_parallel.layout.choices import (
    DATA_PARALLEL,
    PARTITION_METHODS,
    V_SCHEDULES,
    is_multi_stage,
    schedule_class,
)


def check_positive_int(name: str, value: Any) -> None:
    """Raise a ValueError unless ``value`` is a positive int (not a bool).

    Example::

        >>> check_positive_int("num_microbatches", 4)
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def checked_stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """The stages per rank: given, or implied (2 for the V schedules, else 1), checked against the schedule.

    Example::

        >>> checked_stages_per_rank("zbv", None), checked_stages_per_rank("1f1b", None)
        (2, 1)
    """
    v_shaped = schedule in V_SCHEDULES
    if stages_per_rank is None:
        stages_per_rank = 2 if v_shaped else 1
    check_positive_int("stages_per_rank", stages_per_rank)
    if v_shaped and stages_per_rank != 2:
        raise ValueError(
            f"schedule={schedule!r} runs exactly 2 stages per rank in a V (rank r holds stages r and "
            f"2p-1-r), but stages_per_rank={stages_per_rank}: drop stages_per_rank (it is implied) or "
            f"pass 2"
        )
    multi = is_multi_stage(schedule_class(schedule))
    if multi != (stages_per_rank > 1):
        raise ValueError(
            f"schedule={schedule!r} runs {'several stages' if multi else 'one stage'} per "
            f"rank but stages_per_rank={stages_per_rank}: use stages_per_rank>=2 with the interleaved "
            f"and looped schedules and 1 with 'gpipe' and '1f1b'"
        )
    return stages_per_rank


def checked_partition(partition: Any) -> str | tuple[int, ...]:
    """``"uniform"``, ``"parameters"``, ``"time"`` or a tuple of layer (or block) counts per stage."""
    if isinstance(partition, str):
        if partition not in PARTITION_METHODS:
            raise ValueError(
                f"unknown partition {partition!r}: use one of {', '.join(PARTITION_METHODS)} or a list of "
                f"layer counts per stage"
            )
        return partition
    if isinstance(partition, Sequence) and all(isinstance(n, int) for n in partition):
        return tuple(partition)
    raise TypeError(
        f"partition must be one of {', '.join(PARTITION_METHODS)} or a list of layer counts per stage, "
        f"got {partition!r}"
    )


def checked_data_parallel(data_parallel: Any) -> str:
    """The data-parallel mode, one of :data:`DATA_PARALLEL` (each mode's settings are its technique's).

    Example::

        >>> checked_data_parallel("fsdp")
        'fsdp'
    """
    if not isinstance(data_parallel, str) or data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"unknown data_parallel={data_parallel!r}: use one of {', '.join(map(repr, DATA_PARALLEL))}"
        )
    return data_parallel


def checked_split_points(split_points: Any, partition: Any, module_name: Any) -> tuple[str, ...] | None:
    """Module paths where stages 1, 2, ... begin, or None; they name the stages, so no partition too."""
    if split_points is None:
        return None
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise TypeError(f"split_points must be a list of module paths, got {split_points!r}")
    if partition != "uniform" or module_name is not None:
        raise ValueError(
            "split_points names the stage beginnings itself: drop partition= and module_name=, or drop "
            "split_points"
        )
    return tuple(split_points)
