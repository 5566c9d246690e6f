"""The order in which each pipeline rank runs forwards and backwards, read from torch's own schedules.

``torch.distributed.pipelining`` describes every schedule as plain data: ``schedule.pipeline_order``
maps each rank to its list of actions (forward ``F``, full backward ``B``, input/weight backward ``I``
/ ``W`` for zero-bubble schedules, ``None`` for an idle slot). Building a schedule needs stage
objects only for a few attributes, so light stand-ins are enough and no process group is involved.
The memory planner walks these lists to know how many micro-batches each stage keeps in flight.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleGPipe

from lightning_parallel.layout.choices import is_multi_stage, schedule_class

COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: ``kind`` in :data:`COMPUTE`, on ``stage`` for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


def rank_actions(
    schedule: str, pp_size: int, stages_per_rank: int, num_microbatches: int
) -> list[list[Action]]:
    """Each pipeline rank's compute actions, in the order torch's schedule runs them.

    Mirrors the runner: a single-stage schedule other than GPipe with fewer micro-batches than
    stages runs as GPipe (``PipelineRunner._schedule``).

    Example::

        >>> [a.kind for a in rank_actions("gpipe", 2, 1, 2)[0]]
        ['F', 'F', 'B', 'B']
    """
    return [list(actions) for actions in _rank_actions(schedule, pp_size, stages_per_rank, num_microbatches)]


@functools.lru_cache(maxsize=256)
def _rank_actions(
    schedule: str, pp_size: int, stages_per_rank: int, num_microbatches: int
) -> tuple[tuple[Action, ...], ...]:
    """:func:`rank_actions`, built once per schedule shape (the planner asks for each many times)."""
    cls = schedule_class(schedule)
    if not is_multi_stage(cls) and num_microbatches < pp_size and cls is not ScheduleGPipe:
        cls = ScheduleGPipe
    order = _pipeline_order(cls, pp_size, stages_per_rank, num_microbatches)
    out = []
    for rank in range(pp_size):
        actions, count = [], Counter()
        for a in order[rank]:
            kind = getattr(a, "computation_type", None)
            kind = _KIND.get(str(getattr(kind, "value", kind)), "")
            if a is not None and kind in COMPUTE:
                # Each stage runs its micro-batches in order, as the runtime does; the k-th action of a
                # kind is micro-batch k (torch 2.13's Schedule1F1B order numbers the last rank's
                # forwards from 1: its runtime does not, so the index is not read from the order).
                stage = int(a.stage_index)
                count[(kind, stage)] += 1
                actions.append(Action(kind, stage, count[(kind, stage)] - 1))
        out.append(tuple(actions))
    return tuple(out)


def peak_in_flight(actions: list[Action]) -> dict[int, int]:
    """The most micro-batches each stage of a rank holds activations for at once (forward done, not freed).

    A full backward (``B``) frees a micro-batch; with split backwards the weight pass (``W``) does.

    Example::

        >>> peak_in_flight(rank_actions("1f1b", 4, 1, 8)[1])
        {1: 3}
    """
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in actions:
        if a.kind == "F":
            live[a.stage] = live.get(a.stage, 0) + 1
            peak[a.stage] = max(peak.get(a.stage, 0), live[a.stage])
        elif a.kind in ("B", "W"):
            live[a.stage] = live.get(a.stage, 0) - 1
    return peak


_KIND = {"F": "F", "FORWARD": "F", "B": "B", "FULL_BACKWARD": "B", "I": "I", "BACKWARD_INPUT": "I",
         "W": "W", "BACKWARD_WEIGHT": "W"}  # fmt: skip


def _pipeline_order(cls: type, pp_size: int, stages_per_rank: int, num_microbatches: int) -> dict:
    """``cls(...).pipeline_order`` built on stand-in stages (torch 2.13 reads only these attributes).

    test_memory_schedule.py checks the orders against known ones, so a change in torch fails loudly.
    """
    num_stages = pp_size * stages_per_rank
    if not issubclass(cls, PipelineScheduleMulti):
        return cls(SimpleNamespace(num_stages=num_stages), num_microbatches, loss_fn=_no_loss).pipeline_order
    stages = [_stand_in(num_stages, pp_size, i * pp_size) for i in range(stages_per_rank)]
    return cls(stages, num_microbatches, loss_fn=_no_loss).pipeline_order


def _stand_in(num_stages: int, pp_size: int, index: int) -> SimpleNamespace:
    fields = dict(num_stages=num_stages, group_size=pp_size, group_rank=0, stage_index=index)
    return SimpleNamespace(
        **fields, is_first=index == 0, is_last=index == num_stages - 1, submod=nn.Identity()
    )


def _no_loss(*_args: object) -> None:
    return None
