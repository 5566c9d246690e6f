"""One parallel configuration to size: DDP, or a pipeline shape with its schedule and memory options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_parallel.pipeline.runner import SCHEDULES, is_multi_stage, schedule_class

PRECISIONS = {
    "32-true": (None, None),
    "bf16-mixed": (None, torch.bfloat16),
    "16-mixed": (None, torch.float16),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
}
"""precision -> (parameter dtype, autocast dtype); ``None``: the model's own dtype / no autocast."""

LOSS_SCALER_BYTES = {"16-mixed": 4 * 4}
"""The GradScaler's state per rank (``16-mixed``): the scale, its growth tracker, 1/scale and the
optimizer's found_inf, one 4-byte scalar each; every rank holds it (the pipeline keeps it identical)."""


STRATEGIES = ("single_device", "ddp", "pipeline")
DATA_PARALLEL = ("replicate", "zero1", "fsdp")  # as PipelineStrategy(data_parallel=...)


@dataclass(frozen=True)
class ParallelConfig:
    """A training configuration to size, the same knobs as ``PipelineStrategy`` (or plain DDP).

    Args:
        strategy: ``"single_device"`` (one process, no DDP wrapper: ``Trainer(devices=1)``), ``"ddp"``
            (every rank holds the whole model, plus DDP's gradient buckets) or ``"pipeline"``.
        devices: ranks in all.
        pipeline_size: pipeline ranks per replica (as PipelineStrategy's).
        num_microbatches, schedule, stages_per_rank, partition: as PipelineStrategy.
        activation_checkpointing: ``True``, a list of unit names, or a callable ``(name, module) -> bool``.
        shard_optimizer_state: ZeRO-1 over each stage's replicas (``data_parallel="zero1"``).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"`` or ``"16-true"``.
        accumulate_grad_batches: batches per optimizer step (as the Trainer's). Inside a window a
            pipeline rank holds the accumulated gradients through the whole schedule.
        compiled: the stages are compiled (``PipelineStrategy(compile=...)``). The activations are
            still those eager saves, measured on the eager model: inductor's fused kernels usually save
            fewer (its partitioner recomputes cheap pointwise ops in backward), so the prediction is then
            an estimate from above, said so in the table.

    Example::

        >>> ParallelConfig("pipeline", devices=4, pipeline_size=2, num_microbatches=8, schedule="1f1b",
        ...                activation_checkpointing=True, shard_optimizer_state=True).label()
        'pp 2x2 1f1b m=8 +ac +zero'
        >>> ParallelConfig("pipeline", devices=8, pipeline_size=2, num_microbatches=4, data_parallel="fsdp",
        ...                data_parallel_shard_size=2).label()
        'pp 2x4 1f1b m=4 +hsdp 2x2'
    """

    strategy: str = "ddp"
    devices: int = 1
    pipeline_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    partition: str | tuple[int, ...] = "uniform"
    activation_checkpointing: bool | tuple[str, ...] | Callable[[str, Any], bool] = False
    shard_optimizer_state: bool = False
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    data_parallel: str = "replicate"
    data_parallel_shard_size: int | None = None
    tensor_parallel_size: int = 1
    compiled: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGIES)} (or a PipelineStrategy), "
                f"got {self.strategy!r}"
            )
        if self.strategy == "single_device" and self.devices != 1:
            raise ValueError(
                f"strategy='single_device' runs on one device, got devices={self.devices}: use 'ddp' "
                "(or 'auto') for several"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        for name in (
            "devices",
            "pipeline_size",
            "num_microbatches",
            "stages_per_rank",
            "accumulate_grad_batches",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.tensor_parallel_size > 1 and self.strategy != "pipeline":
            raise ValueError("tensor_parallel_size > 1 is modelled for strategy='pipeline' only")
        if self.tensor_parallel_size > 1 and self.devices % (self.pipeline_size * self.tensor_parallel_size):
            raise ValueError(
                f"pipeline_size x tensor_parallel_size ({self.pipeline_size} x {self.tensor_parallel_size}) "
                f"does not divide devices ({self.devices})"
            )
        if self.devices % self.pipeline_size:
            raise ValueError(
                f"pipeline_size ({self.pipeline_size}) does not divide devices ({self.devices}): use a "
                f"multiple of {self.pipeline_size} devices"
            )
        if self.strategy == "pipeline":
            multi = is_multi_stage(schedule_class(self.schedule))
            if multi != (self.stages_per_rank > 1):
                raise ValueError(
                    f"schedule={self.schedule!r} needs stages_per_rank {'>= 2' if multi else '= 1'}, got "
                    f"{self.stages_per_rank}"
                )
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        if self.data_parallel not in DATA_PARALLEL:
            modes = ", ".join(map(repr, DATA_PARALLEL))
            raise ValueError(f"unknown data_parallel={self.data_parallel!r}: use one of {modes}")
        if self.shard_optimizer_state and self.data_parallel == "fsdp":
            raise ValueError("shard_optimizer_state=True is data_parallel='zero1': pass only one of them")
        if self.data_parallel == "zero1":  # one spelling inside: shard_optimizer_state
            object.__setattr__(self, "shard_optimizer_state", True)
        if self.shard_optimizer_state:
            object.__setattr__(self, "data_parallel", "zero1")
        if self.data_parallel == "fsdp" and self.strategy != "pipeline":
            raise ValueError(
                f"data_parallel='fsdp' shards the stages of a pipeline, but strategy={self.strategy!r}: use "
                f"strategy='pipeline' (pipeline_size=1 for FSDP alone)"
            )
        size = self.data_parallel_shard_size
        if size is not None:
            if self.data_parallel != "fsdp":
                raise ValueError(
                    f"data_parallel_shard_size={size} shards stages with FSDP2: use data_parallel='fsdp'"
                )
            if not isinstance(size, int) or size < 1 or (self.devices // self.pipeline_size) % size:
                raise ValueError(
                    f"data_parallel_shard_size ({size!r}) does not divide the "
                    f"{self.devices // self.pipeline_size} data-parallel ranks of each stage: use a divisor"
                )

    @property
    def shard_size(self) -> int:
        """The ranks each stage's parameters are sharded over (1 unless ``data_parallel="fsdp"``)."""
        if self.data_parallel != "fsdp":
            return 1
        return self.data_parallel_shard_size or self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        if self.strategy != "pipeline":
            return self.devices
        return self.devices // (self.pipeline_size * self.tensor_parallel_size)

    @property
    def num_stages(self) -> int:
        return self.pipeline_size * self.stages_per_rank if self.strategy == "pipeline" else 1

    def label(self) -> str:
        """A short name: ``"single device"``, ``"ddp x4"``, ``"pp 2x2 1f1b m=8 +ac +zero"`` (pp x dp)."""
        if self.strategy == "single_device":
            return "single device"
        if self.strategy == "ddp":
            return f"ddp x{self.devices}"
        v = f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        flags = " +ac" if self.activation_checkpointing else ""
        flags += " +zero" if self.shard_optimizer_state else ""
        if self.data_parallel == "fsdp":
            replicas = self.data_parallel_size // self.shard_size
            flags += f" +hsdp {replicas}x{self.shard_size}" if replicas > 1 else " +fsdp"
        flags += f" tp={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        flags += " +compile" if self.compiled else ""
        shape = f"{self.pipeline_size}x{self.data_parallel_size}"
        return f"pp {shape} {self.schedule}{v} m={self.num_microbatches}{flags}"


def resolve(strategy: Any, devices: int, precision: str) -> ParallelConfig:
    """A :class:`ParallelConfig` from ``"auto"``, ``"ddp"``, ``"pipeline"``, a config or a PipelineStrategy.

    ``"auto"`` (or None) is what ``Trainer(devices=...)`` runs: one device without DDP, several with
    DDP. A PipelineStrategy is read through its attributes (this package does not import Lightning).

    Example::

        >>> resolve("auto", devices=1, precision="32-true").label()  # Trainer(devices=1): no DDP
        'single device'
        >>> resolve("auto", devices=4, precision="32-true").label()
        'ddp x4'
        >>> resolve(PipelineStrategy(pipeline_size=2), devices=4, precision="bf16-mixed")  # doctest: +SKIP
    """
    if isinstance(strategy, ParallelConfig):
        return replace(strategy, devices=devices, precision=precision)
    if strategy in ("auto", None):
        strategy = "single_device" if devices == 1 else "ddp"
    if strategy in ("ddp", "single_device"):
        return ParallelConfig(strategy, devices=devices, precision=precision)
    if strategy == "pipeline":
        return ParallelConfig("pipeline", devices, devices, 4, precision=precision)
    if hasattr(strategy, "num_microbatches") and hasattr(strategy, "schedule"):
        checkpointing = getattr(strategy, "activation_checkpointing", False)
        if isinstance(checkpointing, list):
            checkpointing = tuple(checkpointing)
        partition = strategy.partition
        return ParallelConfig(
            "pipeline",
            devices=devices,
            pipeline_size=_pipeline_size(strategy) or devices,
            num_microbatches=strategy.num_microbatches,
            schedule=strategy.schedule,
            stages_per_rank=getattr(strategy, "stages_per_rank", 1),
            partition=tuple(partition) if isinstance(partition, list) else partition,
            activation_checkpointing=checkpointing,
            shard_optimizer_state=bool(getattr(strategy, "shard_optimizer_state", False)),
            precision=precision,
            data_parallel=getattr(strategy, "data_parallel", "replicate"),
            data_parallel_shard_size=_config_value(strategy, "data_parallel_shard_size"),
            tensor_parallel_size=getattr(strategy, "tensor_parallel_size", 1),
            compiled=_config_value(strategy, "compile") is not None,
        )
    raise ValueError(
        "strategy must be 'auto', 'single_device', 'ddp', 'pipeline', a ParallelConfig or a "
        f"PipelineStrategy, got {strategy!r}; "
        f"the schedules are {', '.join(SCHEDULES)}"
    )


def _config_value(strategy: Any, name: str) -> Any:
    config = getattr(strategy, "config", None)
    return getattr(config, name, None) if config is not None else getattr(strategy, name, None)


def _pipeline_size(strategy: Any) -> int | None:
    """The pipeline size a PipelineStrategy was given (None: all devices), before any Trainer set it up."""
    config = getattr(strategy, "config", None)  # PipelineStrategy keeps its settings there
    if config is not None and hasattr(config, "pipeline_size"):
        return config.pipeline_size
    return getattr(strategy, "num_stages", None)
