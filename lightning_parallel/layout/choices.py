"""The choice lists of a plan, each defined once: schedules, data-parallel modes, partitions, precisions."""

from __future__ import annotations

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

STRATEGIES = ("single_device", "ddp", "pipeline")
"""``"single_device"`` (``Trainer(devices=1)``), ``"ddp"`` (Lightning's DDPStrategy) or ``"pipeline"``."""

SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv",
    "dualpipev",
)
"""torch.distributed.pipelining's schedules, by their snake_case names."""

V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that place two stages per rank in a V: rank r holds stages r and 2p-1-r."""

SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")
"""Schedules that split each backward into an input and a weight pass (zero bubble)."""

DATA_PARALLEL = ("replicate", "zero1", "fsdp")
"""How the data-parallel ranks of a stage share it: whole replicas, sharded optimizer state, FSDP2."""

OFFLOAD_TARGETS = ("optimizer", "parameters", "activations")
"""What can live on the host: the optimizer state and its step (gradients in, parameters out, once per
step), an FSDP2 stage's sharded parameters and gradients (FSDP2's CPUOffloadPolicy, which takes the
optimizer state with them), and the saved activations of the micro-batches in flight."""

PARTITION_METHODS = ("uniform", "parameters", "time")
"""How stages are balanced (or an explicit list of layer/block counts per stage)."""

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
"""The Trainer's precisions a plan is sized for."""

_TORCH_NAMES = {"zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def schedule_class(name: str) -> type:
    """The torch schedule class for one of :data:`SCHEDULES` (snake_case names).

    Example::

        >>> schedule_class("1f1b").__name__
        'Schedule1F1B'
    """
    if not isinstance(name, str) or name.lower() not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    name = name.lower()
    return get_schedule_class(_TORCH_NAMES.get(name, name.replace("_", "")))


def is_multi_stage(cls: type) -> bool:
    """Whether the schedule runs several stages per rank (interleaved/looped)."""
    return issubclass(cls, PipelineScheduleMulti)


def placement(name: str) -> str:
    """How a schedule places its stages on the pipeline ranks: ``"v"`` (ZBV, DualPipeV) or ``"loop"``.

    Example::

        >>> placement("zbv"), placement("interleaved_1f1b")
        ('v', 'loop')
    """
    return "v" if name.lower() in V_SCHEDULES else "loop"
