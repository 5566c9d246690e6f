"""Each setting of a plan checked on its own, with the value and the fix in every error.

:class:`~lightning_parallel.plan.parallel_plan.ParallelPlan` calls these once, when it is made; what
depends on several settings together (sizes against the devices) is checked there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_parallel._options import unknown_option_error
from lightning_parallel.layout.choices import (
    DATA_PARALLEL,
    OFFLOAD_TARGETS,
    PARTITION_METHODS,
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
    is_multi_stage,
    schedule_class,
)

Selection = bool | Callable[[str, nn.Module], bool] | Sequence[str]
"""Which units recompute: ``True`` (all), ``False``, a list of unit names or ``(name, module) -> bool``."""

CompileOptions = dict[str, Any]
"""torch.compile's keywords for each stage's blocks."""

COMPILE_KEYS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable", "recompile_limit")
"""torch.compile's keywords a stage takes (``model`` is the stage's own module)."""


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


def checked_data_parallel(data_parallel: Any, shard_size: Any) -> str:
    """The data-parallel mode, one of :data:`DATA_PARALLEL`; a shard size only with ``"fsdp"``."""
    if not isinstance(data_parallel, str) or data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"unknown data_parallel={data_parallel!r}: use one of {', '.join(map(repr, DATA_PARALLEL))}"
        )
    if shard_size is not None:
        check_positive_int("data_parallel_shard_size", shard_size)
        if data_parallel != "fsdp":
            raise ValueError(
                f"data_parallel_shard_size={shard_size} shards stages with FSDP2, but data_parallel="
                f"{data_parallel!r}: use data_parallel='fsdp', or drop data_parallel_shard_size"
            )
    return data_parallel


def check_tensor_parallel(size: Any, plan: Any, data_parallel: str) -> None:
    """The tensor-parallel size and plan, and what they cannot go with."""
    check_positive_int("tensor_parallel_size", size)
    if plan is not None:
        if not isinstance(plan, Mapping):
            raise TypeError(
                f"tensor_parallel_plan must be a dict {{module path pattern: ParallelStyle}} (as "
                f"parallelize_module takes), got {type(plan).__name__}"
            )
        if size == 1:
            raise ValueError(
                "tensor_parallel_plan splits layers over tensor-parallel ranks, but tensor_parallel_size=1: "
                "pass tensor_parallel_size > 1, or drop tensor_parallel_plan"
            )
    # torch workaround: no upstream issue found
    #   canary: test_zero_redundancy_optimizer_steps_dtensor_parameters
    if size > 1 and data_parallel == "zero1":
        raise ValueError(
            f"tensor_parallel_size={size} with data_parallel='zero1' is not supported: torch's "
            f"ZeroRedundancyOptimizer broadcasts plain tensors, not the DTensor slices of split weights. "
            f"Use data_parallel='fsdp' (shards parameters, gradients and optimizer state) or 'replicate'"
        )


def checked_compile_options(value: Any) -> CompileOptions | None:
    """``compile=`` as the stages take it: ``None`` (off), or the keywords for ``torch.compile``.

    ``True`` is torch.compile's defaults with ``dynamic=True``; a dict is torch.compile's keywords
    (``{"mode": "max-autotune-no-cudagraphs"}``, ``{"backend": "aot_eager"}``), ``dynamic`` defaulting
    to True there too.

    Raises:
        TypeError: neither a bool nor a dict, or a key that torch.compile does not take (naming the
            closest one).

    Example::

        >>> checked_compile_options(True)
        {'dynamic': True}
        >>> checked_compile_options({"mode": "max-autotune-no-cudagraphs"})["mode"]
        'max-autotune-no-cudagraphs'
        >>> checked_compile_options(False) is None
        True
    """
    if value is None or value is False:
        return None
    if value is True:
        return {"dynamic": True}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile's options (e.g. {{'mode': "
            f"'max-autotune-no-cudagraphs'}}), got {type(value).__name__}"
        )
    for key in value:
        if key not in COMPILE_KEYS:
            raise unknown_option_error("PipelineStrategy(compile={...})", str(key), COMPILE_KEYS)
    return {"dynamic": True, **value}


def check_compile(options: CompileOptions | None, schedule: str, tensor_parallel_size: int) -> None:
    """Refuse compiled stages where torch 2.13 cannot run them (see ``techniques/compile.py``).

    Raises:
        ValueError: a schedule that splits each backward, or tensor-parallel stages.

    Example::

        >>> check_compile({"dynamic": True}, "1f1b", 1)     # fine
        >>> check_compile(None, "zbv", 2)                   # fine: nothing compiled
    """
    if options is None:
        return
    # torch workaround: https://github.com/pytorch/pytorch/issues/161904
    #   canary: test_torch_split_backward_schedules_take_compiled_stages
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"compile with schedule={schedule!r} is not supported: that schedule splits each backward "
            f"into an input and a weight pass, and a compiled block's backward is one fused function "
            f"(torch 2.13 refuses compiled stages there, pytorch#161904; in place its weight pass reruns "
            f"it and gave wrong gradients). Use compile with '1f1b', 'gpipe', 'interleaved_1f1b' or "
            f"'looped_bfs', or compile=False with {schedule!r}"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"compile with tensor_parallel_size={tensor_parallel_size} is not supported: torch 2.13 fails to "
            f"compile blocks whose weights are tensor-parallel DTensors (AOTAutograd's tracing recurses "
            f"without end). Use compile with tensor_parallel_size=1, or tensor parallelism without compile"
        )


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


def checked_offload(offload: Any, data_parallel: str) -> tuple[str, ...]:
    """What lives on the host, as a sorted tuple of :data:`OFFLOAD_TARGETS` (a name or a list of names).

    ``"parameters"`` is FSDP2's offload, which takes the optimizer state with it (all or nothing): it
    implies ``"optimizer"`` and needs ``data_parallel="fsdp"``; an FSDP2 stage cannot offload its
    optimizer state alone.

    Example::

        >>> checked_offload("optimizer", "replicate")
        ('optimizer',)
        >>> checked_offload(["parameters"], "fsdp")
        ('optimizer', 'parameters')
    """
    if offload is None or offload is False:
        return ()
    names = (offload,) if isinstance(offload, str) else offload
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"offload must be one of {', '.join(map(repr, OFFLOAD_TARGETS))} or a list of them, got "
            f"{offload!r}"
        )
    for name in names:
        if name not in OFFLOAD_TARGETS:
            raise unknown_option_error("PipelineStrategy(offload=...)", name, OFFLOAD_TARGETS)
    chosen = set(names) | ({"optimizer"} if "parameters" in names else set())
    if "parameters" in chosen and data_parallel != "fsdp":
        raise ValueError(
            f"offload='parameters' is FSDP2's offload of each stage's sharded parameters and gradients, but "
            f"data_parallel={data_parallel!r}: use data_parallel='fsdp', or offload='optimizer' (the "
            f"optimizer state and its step on the host)"
        )
    if data_parallel == "fsdp" and "optimizer" in chosen and "parameters" not in chosen:
        raise ValueError(
            "data_parallel='fsdp' offloads the optimizer state only together with the sharded parameters "
            "and gradients (FSDP2's CPUOffloadPolicy is all or nothing, pytorch#187615): pass "
            "offload='parameters', or use data_parallel='replicate' or 'zero1' with offload='optimizer'"
        )
    return tuple(sorted(chosen))


def check_offload(offload: tuple[str, ...], tensor_parallel_size: int, parallelize_fn: Any) -> None:
    """Refuse offload where it is not supported yet, with the reason and the fix.

    Raises:
        ValueError: offload with tensor-parallel stages; FSDP2's offload with a ``parallelize_fn``.

    Example::

        >>> check_offload(("optimizer",), 1, None)          # fine
    """
    if offload and tensor_parallel_size > 1:
        raise ValueError(
            f"offload={list(offload)} with tensor_parallel_size={tensor_parallel_size} is not supported yet: "
            f"the host copies and their checkpoints are written for whole tensors, not tensor-parallel "
            f"DTensor slices, and FSDP2's offload of 2-D shards is untested here. Use tensor_parallel_size=1 "
            f"(data_parallel='fsdp' with offload='parameters' shards each stage over all its ranks instead), "
            f"or drop offload"
        )
    if "parameters" in offload and parallelize_fn is not None:
        raise ValueError(
            "offload='parameters' with a parallelize_fn is not supported: a stage your function shards "
            "with fully_shard would keep its shards on the device (PipelineStrategy gives FSDP2's "
            "CPUOffloadPolicy to the stages it shards itself). Drop parallelize_fn and let "
            "data_parallel='fsdp' shard the stages, or pass offload_policy=CPUOffloadPolicy() to your "
            "own fully_shard and drop offload='parameters'"
        )
