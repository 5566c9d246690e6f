"""PipelineStrategy's settings: validated once at construction, with the values and the fix in each error."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

from lightning_parallel.parallelize.compile import (
    CompileOptions,
    check_schedule,
    check_tensor_parallel,
    checked_compile_options,
)
from lightning_parallel.parallelize.recompute import Selection, check_selection
from lightning_parallel.parallelize.stages import DATA_PARALLEL
from lightning_parallel.pipeline.partition import PARTITION_METHODS
from lightning_parallel.pipeline.runner import V_SCHEDULES, is_multi_stage, schedule_class


@dataclass(frozen=True)
class PipelineConfig:
    """The strategy's pipeline settings, validated in ``PipelineStrategy.__init__``."""

    pipeline_size: int | None
    num_microbatches: int
    schedule: str
    stages_per_rank: int
    partition: str | list[int]
    module_name: str | None
    split_points: tuple[str, ...] | None
    activation_checkpointing: Selection = False
    shard_optimizer_state: bool = False  # data_parallel == "zero1", kept for the code that reads it
    data_parallel: str = "replicate"
    data_parallel_shard_size: int | None = None  # "fsdp": ranks a stage is sharded over (None: all)
    parallelize_fn: Callable[..., Any] | None = None
    save_distributed_checkpoint: bool = False  # a torch.distributed.checkpoint directory, not one file
    tensor_parallel_size: int = 1
    tensor_parallel_plan: Mapping[str, Any] | None = None  # module path pattern -> ParallelStyle
    compile: CompileOptions | None = None  # torch.compile's keywords for each stage's blocks (None: eager)


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


def checked_config(
    pipeline_size: int | None,
    num_microbatches: int,
    schedule: str,
    stages_per_rank: int | None,
    partition: str | list[int],
    module_name: str | None,
    split_points: list[str] | None,
    activation_checkpointing: Selection = False,
    shard_optimizer_state: bool = False,
    data_parallel: str | None = None,
    data_parallel_shard_size: int | None = None,
    parallelize_fn: Callable[..., Any] | None = None,
    save_distributed_checkpoint: bool = False,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: Mapping[str, Any] | None = None,
    compile: Any = False,
) -> PipelineConfig:
    """Every setting checked, with the value and the fix in each error; the config all ranks share."""
    cls = schedule_class(schedule)
    check_selection(activation_checkpointing)
    data_parallel = checked_data_parallel(data_parallel, shard_optimizer_state, data_parallel_shard_size)
    if parallelize_fn is not None and not callable(parallelize_fn):
        raise TypeError(
            f"parallelize_fn must be a callable (stage_module, device_mesh) -> None, got {parallelize_fn!r}"
        )
    if not isinstance(save_distributed_checkpoint, bool):
        raise TypeError(
            "save_distributed_checkpoint must be True (a torch.distributed.checkpoint directory, each rank "
            f"writing its own shards) or False (one consolidated file), got {save_distributed_checkpoint!r}"
        )
    _check_positive_int("num_microbatches", num_microbatches)
    _check_tensor_parallel(tensor_parallel_size, tensor_parallel_plan, data_parallel)
    stages_per_rank = _stages_per_rank(schedule, stages_per_rank)
    compile_options = checked_compile_options(compile)
    check_schedule(compile_options, schedule)
    check_tensor_parallel(compile_options, tensor_parallel_size)
    if pipeline_size is not None:
        _check_positive_int("pipeline_size", pipeline_size)
    if is_multi_stage(cls) != (stages_per_rank > 1):
        raise ValueError(
            f"schedule={schedule!r} runs {'several stages' if is_multi_stage(cls) else 'one stage'} per "
            f"rank but stages_per_rank={stages_per_rank}: use stages_per_rank>=2 with the interleaved "
            f"and looped schedules and 1 with 'gpipe' and '1f1b'"
        )
    if isinstance(partition, str) and partition not in PARTITION_METHODS:
        raise ValueError(
            f"unknown partition {partition!r}: use one of {', '.join(PARTITION_METHODS)} or a list of "
            f"layer counts per stage"
        )
    if split_points is not None:
        if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
            raise TypeError(f"split_points must be a list of module paths, got {split_points!r}")
        if partition != "uniform" or module_name is not None:
            raise ValueError(
                "split_points names the stage beginnings itself: drop partition= and module_name=, or drop "
                "split_points"
            )
        split_points = tuple(split_points)
    return PipelineConfig(
        pipeline_size,
        num_microbatches,
        schedule.lower(),
        stages_per_rank,
        partition,
        module_name,
        split_points,
        activation_checkpointing,
        data_parallel == "zero1",
        data_parallel,
        data_parallel_shard_size,
        parallelize_fn,
        save_distributed_checkpoint,
        tensor_parallel_size,
        dict(tensor_parallel_plan) if tensor_parallel_plan is not None else None,
        compile_options,
    )


def _check_tensor_parallel(size: Any, plan: Any, data_parallel: str) -> None:
    _check_positive_int("tensor_parallel_size", size)
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


def _stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """The stages per rank: given, or implied (2 for the V schedules, else 1); a V schedule needs 2."""
    v_shaped = schedule.lower() in V_SCHEDULES
    if stages_per_rank is None:
        return 2 if v_shaped else 1
    _check_positive_int("stages_per_rank", stages_per_rank)
    if v_shaped and stages_per_rank != 2:
        raise ValueError(
            f"schedule={schedule!r} runs exactly 2 stages per rank in a V (rank r holds stages r and "
            f"2p-1-r), but stages_per_rank={stages_per_rank}: drop stages_per_rank (it is implied) or "
            f"pass 2"
        )
    return stages_per_rank


def checked_data_parallel(
    data_parallel: str | None, shard_optimizer_state: bool, shard_size: int | None
) -> str:
    """The data-parallel mode: ``data_parallel``, or ``"zero1"`` from the older ``shard_optimizer_state``."""
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(f"shard_optimizer_state must be True or False, got {shard_optimizer_state!r}")
    if data_parallel is None:
        data_parallel = "zero1" if shard_optimizer_state else "replicate"
    if not isinstance(data_parallel, str) or data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"unknown data_parallel={data_parallel!r}: use one of {', '.join(map(repr, DATA_PARALLEL))}"
        )
    if shard_optimizer_state and data_parallel != "zero1":
        raise ValueError(
            f"shard_optimizer_state=True is data_parallel='zero1', but data_parallel={data_parallel!r} was "
            f"also given: pass only one of them"
        )
    if shard_size is not None:
        _check_positive_int("data_parallel_shard_size", shard_size)
        if data_parallel != "fsdp":
            raise ValueError(
                f"data_parallel_shard_size={shard_size} shards stages with FSDP2, but data_parallel="
                f"{data_parallel!r}: use data_parallel='fsdp', or drop data_parallel_shard_size"
            )
    return data_parallel


def refuse_traced_parallelize(config: PipelineConfig) -> None:
    """What the traced path's stages cannot take: say why, before its split."""
    if config.parallelize_fn is not None:
        raise ValueError(
            "parallelize_fn needs the stage modules of a split nn.Sequential, but this module is split by "
            "tracing its forward: a traced stage is an export graph that reads its weights directly, with "
            "no modules of yours to parallelize. Hold the layers in one top-level nn.Sequential, or drop "
            'parallelize_fn (data_parallel="fsdp" shards traced stages too)'
        )
    if config.data_parallel == "fsdp" and config.stages_per_rank > 1:
        raise ValueError(
            f'data_parallel="fsdp" with stages_per_rank={config.stages_per_rank} is not supported for a '
            f"traced forward: each traced stage is sharded as one FSDP root holding this rank's modules, "
            f"so a rank can hold one stage. Use stages_per_rank=1 (schedule='1f1b' or 'gpipe'), or hold the "
            f"layers in one top-level nn.Sequential"
        )


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def refuse_compiled_module(module: Any) -> None:
    """A LightningModule compiled by ``torch.compile(model)``: refused, with the one-line fix.

    Lightning unwraps the ``OptimizedModule`` and sets the compiled ``forward`` and step methods on the
    module itself, which cannot be pickled for spawned workers and would compile the user's step around
    the pipeline; the stages are compiled by the strategy instead, after the split.
    """
    if getattr(module, "_compiler_ctx", None) is not None:
        raise ValueError(
            f"{type(module).__name__} was compiled with torch.compile(model); PipelineStrategy splits the "
            f"module first and compiles each stage's blocks itself: pass the module uncompiled and use "
            f"PipelineStrategy(compile=True) (or compile={{...torch.compile's options}})"
        )


def check_fit_supported(trainer: pl.Trainer, strategy: Any) -> None:
    if not trainer.lightning_module.automatic_optimization:
        raise ValueError(
            "PipelineStrategy supports automatic optimization only (it runs forward and backward inside "
            f"its schedule), and {type(trainer.lightning_module).__name__} sets "
            "`self.automatic_optimization = False`: remove that line"
        )


def refuse_unsupported_callbacks(trainer: pl.Trainer) -> None:
    """Refuse, on every rank before any process group work, the callbacks that cannot run on split stages."""
    from lightning.pytorch.callbacks import BatchSizeFinder, StochasticWeightAveraging, WeightAveraging

    for callback in trainer.callbacks:
        name = type(callback).__name__
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            raise ValueError(
                f"{name} is not supported under PipelineStrategy: it averages a copy of the whole module "
                f"taken before the strategy splits it into stages, and a checkpoint keeps the copy of "
                f"global rank 0 only. Train without it and average the weights offline: the consolidated "
                f"checkpoints of the last epochs (consolidate_checkpoint for distributed ones)"
            )
        if isinstance(callback, BatchSizeFinder):
            raise ValueError(
                f"{name} is not supported under PipelineStrategy (Lightning tunes the batch size on one "
                f"device only): find it with Tuner(L.Trainer(devices=1)).scale_batch_size(model), then "
                f"give each data-parallel replica that batch size (a multiple of num_microbatches)"
            )
