"""ONE parallel plan: what ``PipelineStrategy`` runs and what the memory planner sizes and returns.

As torchtitan's ``ParallelDims``: the sizes of every parallelism (pipeline, data-parallel replicas and
shards, tensor), the schedule and its micro-batches, and each technique's setting (recomputation,
sharded optimizer state, FSDP2, compile, precision), validated once when the plan is made, with the
value and the fix in each error. ``PipelineStrategy(**options)`` makes one from its options
(``strategy.parallel_plan``), ``PipelineStrategy.from_plan(plan)`` runs one, and every row of the
planner's table (``python -m lightning_parallel.planner``) is one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_parallel._options import checks_options
from lightning_parallel.layout.choices import PRECISIONS, STRATEGIES, V_SCHEDULES, schedule_class
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.plan.checks import (
    check_positive_int,
    checked_data_parallel,
    checked_partition,
    checked_split_points,
    checked_stages_per_rank,
)
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.compile import CompileOptions
from lightning_parallel.techniques.recompute import Selection

# What the Trainer decides, not the strategy: a plan carries them for the planner only.
TRAINER_FIELDS = ("strategy", "devices", "precision", "accumulate_grad_batches")


@dataclass(frozen=True)
class ParallelPlan:
    """One parallel configuration: the sizes, the schedule, and each technique's setting.

    Args:
        strategy: ``"pipeline"`` (``PipelineStrategy``, also with ``pipeline_size=1``: pure data
            parallelism, FSDP2 or tensor parallelism through the same strategy), ``"ddp"``
            (Lightning's ``DDPStrategy``: every rank the whole model, DDP's gradient buckets) or
            ``"single_device"`` (``Trainer(devices=1)``, no DDP wrapper).
        devices: ranks in all (``None``: the Trainer's, known at setup).
        pipeline_size: pipeline ranks per replica (``None``: all devices form one pipeline).
        num_microbatches: micro-batches per batch (a batch it does not divide uses the largest
            divisor of its size: equal micro-batches, exact mean loss).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"``, ``"zbv"`` or ``"dualpipev"`` (the schedules of
            ``torch.distributed.pipelining``; the last two place two stages per rank in a V: rank ``r``
            holds stages ``r`` and ``2p-1-r``).
        stages_per_rank: stages each pipeline rank runs (> 1 for the interleaved and looped
            schedules; implied 2 for ``"zbv"`` and ``"dualpipev"``, 1 for the others); the model is
            cut into ``pipeline_size x stages_per_rank`` stages.
        partition: how to balance the stages: ``"uniform"`` (layer or block counts), ``"parameters"``,
            ``"time"`` (forward+backward time measured on the first batch), or a list of layer (or
            block) counts per stage.
        activation_checkpointing: recompute units in backward instead of keeping their activations:
            ``True`` (every layer of the Sequential, or every block the traced stages call), a list of
            module paths (``["layers.1"]``, ``["h.2", "h.3"]``) or a callable ``(path, module) -> bool``.
            Numbers are unchanged; the activation memory of a stage falls.
        data_parallel: how the data-parallel ranks of a stage share it: ``"replicate"`` (each holds
            the whole stage; gradients all-reduced), ``"zero1"`` (optimizer state sharded, torch's
            ``ZeroRedundancyOptimizer``) or ``"fsdp"`` (parameters, gradients and optimizer state
            sharded with FSDP2 ``fully_shard``, per layer then the stage; a traced stage is one
            unit). Checkpoints hold the full state in every mode.
        data_parallel_shard_size: with ``"fsdp"``, the ranks each stage is sharded over (default: all
            its data-parallel ranks); a smaller divisor replicates the shards (HSDP: shard within a
            node, replicate across nodes).
        overlap_gradient_reduction: the replicas' gradient all-reduce starts in buckets during the
            optimizer step's last backward, each bucket as soon as its gradients are final, and the step
            waits for it before clipping (default ``True``: the same numbers, bitwise; ``False``: the same
            buckets reduced after the schedule, to measure what the overlap hides or where a collective
            beside the schedule costs more than it hides). Not FSDP2's reduce-scatter nor the tied weights.
        bucket_cap_mb: megabytes of gradients per bucket of that all-reduce (as DDP's, default 25).
        tensor_parallel_size: ranks each stage's blocks are split over (Megatron-style, with
            ``parallelize_module``; world size = ``pipeline_size x`` data-parallel ``x
            tensor_parallel_size``). The default plan splits attention q/k/v and the first MLP
            projection column-wise and the output projections row-wise (a split ``nn.Sequential``: and
            divides the head count; a traced forward: its graph runs on DTensors; a Hugging Face model:
            its own ``base_model_tp_plan``). ``data_parallel`` acts over the data-parallel ranks on top.
        tensor_parallel_plan: ``{module path pattern: ParallelStyle}`` (as ``parallelize_module``
            takes; paths from the LightningModule, ``*`` one segment) replacing the default plan (a
            traced forward takes ``ColwiseParallel`` and ``RowwiseParallel``).
        sequence_parallel_size: ranks each sample's sequence is split over (``k``, Ulysses: every rank
            holds ``1/k`` of each sample's tokens through embeddings, MLPs, norms and the loss; an
            all-to-all around each attention gives it every token for ``heads/k`` heads). World size
            = ``pipeline_size x`` data-parallel ``x sequence_parallel_size x tensor_parallel_size``. The
            ``k`` ranks read the same batches; ``k`` must divide the attention heads (and key/value
            heads) and every batch's sequence length (``pad_to_multiple``); the attention must be
            ``F.scaled_dot_product_attention`` (Hugging Face: ``attn_implementation="sdpa"``), causal.
        compile: ``True`` or a dict of ``torch.compile``'s keywords (``{"mode": ...}``, ``{"backend":
            "aot_eager"}``, ``{"dynamic": False}``): each stage's repeated blocks (the Sequential's
            children of its most frequent class; on the traced path, each stage's program) are compiled
            in place after the split, once per stage, with dynamic sizes unless ``dynamic=False``
            (one compiled program serves every length, as one trace does). The compilation runs in the
            first step of each mode; its time is reported apart (``compile_seconds``), and a
            recompile limit reached is warned. Not with the schedules that split backward
            (``"interleaved_zero_bubble"``, ``"zbv"``, ``"dualpipev"``) nor with
            ``tensor_parallel_size > 1``: refused, with the reason.
        offload: what lives on the host instead of the device (``"optimizer"``, ``"parameters"``,
            ``"activations"``, or a list of them): ``"optimizer"`` keeps the optimizer state and runs
            its step on the host (the gradients reach the host once per optimizer step, the updated
            parameters return once), for replicas, ZeRO-1 and FSDP2 (whose shards then stay on the
            device); ``"parameters"`` is FSDP2's offload (``data_parallel="fsdp"``: each stage's
            sharded parameters, gradients and optimizer state on the host, the step there too);
            ``"activations"`` keeps what the micro-batches in flight save for backward on the host
            (what recomputation keeps, with it).
        offload_pin_memory: page-locked host memory for the copies (``None``: when the stages run on
            an accelerator; a CPU-only build cannot pin).
        offload_to: where ``offload="optimizer"`` keeps the state: ``"host"`` (memory) or ``"disk"``
            (files under ``offload_dir``, streamed through a host buffer of ``offload_buffer`` bytes
            per rank in chunks, the next read while the current one steps).
        offload_dir: the disk tier's directory (required with ``offload_to="disk"``); each rank uses
            ``<offload_dir>/rank<R>``, scratch removed when the run ends (checkpoints hold the state).
        offload_buffer: the most the disk tier's host buffer holds per rank, bytes or ``"512MiB"`` (default
            1 GiB; less where the largest param group's chunk takes less: it grows as groups are added).
        precision: the Trainer's precision the plan is sized for (``None``: the Trainer's own).
        accumulate_grad_batches: batches per optimizer step, as the Trainer's (sized by the planner;
            the strategy runs the Trainer's).
        module_name: the attribute holding the ``nn.Sequential`` (default: the module's only one).
        split_points: module paths where stages 1, 2, ... begin (e.g. ``["h.2"]``); traces forward
            even when the module has a top-level Sequential.
        parallelize_fn: ``fn(stage_module, device_mesh)`` run on each stage module after the split,
            before ``data_parallel`` (as torchtitan's ``parallelize_fn``); it changes the module in
            place. A stage it makes an FSDP root is left to it. A split ``nn.Sequential`` only.
        save_distributed_checkpoint: ``True``: checkpoints are ``torch.distributed.checkpoint``
            directories, each rank writing its own shards (no rank gathers the model), resumable at
            another pipeline size or shard count; ``consolidate_checkpoint`` makes one file of one.
            ``False`` (default): one consolidated file from global rank 0.

    Raises:
        ValueError: a value out of range or two settings that do not go together (with the fix).
        TypeError: a value of the wrong kind.

    Example::

        >>> plan = ParallelPlan(devices=8, pipeline_size=2, num_microbatches=8, data_parallel="fsdp",
        ...                     data_parallel_shard_size=2, activation_checkpointing=True)
        >>> plan.label()
        'pp 2x4 1f1b m=8 +ac +hsdp 2x2'
        >>> plan.layout().mesh_shape                        # pp, dp_replicate, dp_shard, tp
        (2, 2, 2, 1)
        >>> plan.code()  # doctest: +NORMALIZE_WHITESPACE
        "PipelineStrategy(pipeline_size=2, num_microbatches=8, activation_checkpointing=True,
        data_parallel='fsdp', data_parallel_shard_size=2)"
    """

    strategy: str = "pipeline"
    devices: int | None = None
    pipeline_size: int | None = None
    num_microbatches: int = 4
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    partition: str | tuple[int, ...] = "uniform"
    activation_checkpointing: Selection = False
    data_parallel: str = "replicate"
    data_parallel_shard_size: int | None = None
    overlap_gradient_reduction: bool = True
    bucket_cap_mb: float = 25.0
    tensor_parallel_size: int = 1
    tensor_parallel_plan: Mapping[str, Any] | None = None
    sequence_parallel_size: int = 1
    compile: CompileOptions | bool | None = None
    offload: tuple[str, ...] | str | None = ()
    offload_pin_memory: bool | None = None
    offload_to: str = "host"
    offload_dir: str | None = None
    offload_buffer: int | str | None = None
    precision: str | None = None
    accumulate_grad_batches: int = 1
    module_name: str | None = None
    split_points: tuple[str, ...] | None = None
    parallelize_fn: Callable[..., Any] | None = None
    save_distributed_checkpoint: bool = False

    def __post_init__(self) -> None:
        # The plan's own settings, then each technique's in the list's order: their canonical values (each
        # may read the settings before it), then what cannot go together; then the plan's shape (split
        # points, stages per rank, devices). A technique's refusal names its own fix, so it comes first.
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGIES)} (or a PipelineStrategy), got "
                f"{self.strategy!r}"
            )
        if self.devices is not None:
            check_positive_int("devices", self.devices)
        for name in ("num_microbatches", "accumulate_grad_batches"):
            check_positive_int(name, getattr(self, name))
        if self.pipeline_size is not None:
            check_positive_int("pipeline_size", self.pipeline_size)
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        self._set("schedule", self.schedule.lower() if isinstance(self.schedule, str) else self.schedule)
        schedule_class(self.schedule)  # (an unknown name: the list of schedules)
        self._set("partition", checked_partition(self.partition))
        checked_data_parallel(self.data_parallel)
        for technique in TECHNIQUES:
            for name, value in technique.normalized(self).items():
                self._set(name, value)
        for technique in TECHNIQUES:
            technique.check(self)
        self._set("split_points", checked_split_points(self.split_points, self.partition, self.module_name))
        if not isinstance(self.save_distributed_checkpoint, bool):
            raise TypeError(
                "save_distributed_checkpoint must be True (a torch.distributed.checkpoint directory, each "
                f"rank writing its own shards) or False (one consolidated file), got "
                f"{self.save_distributed_checkpoint!r}"
            )
        if self.strategy == "pipeline":
            self._set("stages_per_rank", checked_stages_per_rank(self.schedule, self.stages_per_rank))
        else:
            self._whole_model()
        if self.devices is not None and self.strategy == "pipeline":
            self._check_devices(self.devices)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen value, once, in __post_init__

    def _whole_model(self) -> None:
        """DDP and one device: one stage (the techniques refuse what needs a pipeline)."""
        if self.strategy == "single_device" and self.devices not in (None, 1):
            raise ValueError(
                f"strategy='single_device' runs on one device, got devices={self.devices}: use 'ddp' "
                "(or 'auto') for several"
            )
        for name, value in (("pipeline_size", 1), ("num_microbatches", 1), ("stages_per_rank", 1)):
            self._set(name, value)

    def _check_devices(self, devices: int) -> None:
        if self.pipeline_size is None:
            self._set("pipeline_size", devices // self._split_per_stage or 1)
        RankLayout.for_world(
            devices, self.pipeline_size, 1, self.tensor_parallel_size, self.sequence_parallel_size
        )

    # ------------------------------------------------------------------------- derived sizes
    def for_devices(self, devices: int, precision: str | None = None) -> ParallelPlan:
        """This plan on ``devices`` ranks (and ``precision``, if given): the sizes checked against them.

        Example::

            >>> ParallelPlan(pipeline_size=2).for_devices(4).data_parallel_size
            2
        """
        return replace(self, devices=devices, precision=precision or self.precision)

    @property
    def world(self) -> int:
        if self.devices is None:
            raise ValueError("this plan has no device count yet: use plan.for_devices(n)")
        return self.devices

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel ranks of each stage (replicas x shards); the devices under DDP."""
        if self.strategy != "pipeline":
            return self.world
        return self.world // (self._pipeline_ranks * self._split_per_stage)

    @property
    def shard_size(self) -> int:
        """The ranks each stage's parameters are sharded over (1 unless ``data_parallel="fsdp"``)."""
        if self.data_parallel != "fsdp":
            return 1
        return self.data_parallel_shard_size or self.data_parallel_size

    @property
    def shard_optimizer_state(self) -> bool:
        """Whether optimizer state is sharded over the replicas (ZeRO-1, ``data_parallel="zero1"``)."""
        return self.data_parallel == "zero1"

    @property
    def compiled(self) -> bool:
        return self.compile is not None

    @property
    def num_stages(self) -> int:
        return self._pipeline_ranks * (self.stages_per_rank or 1) if self.strategy == "pipeline" else 1

    @property
    def _pipeline_ranks(self) -> int:
        if self.pipeline_size is None:
            return self.world // self._split_per_stage
        return self.pipeline_size

    @property
    def _split_per_stage(self) -> int:
        """The ranks one stage replica is split over: its sequence x its tensor slices."""
        return self.tensor_parallel_size * self.sequence_parallel_size

    def layout(self, world_size: int | None = None) -> RankLayout:
        """The rank grid (pipeline x data-parallel replicate x shard x sequence x tensor) the mesh is built
        from."""
        plan = self if world_size is None else self.for_devices(world_size)
        if plan.strategy != "pipeline":
            return RankLayout(1, plan.world)
        layout = RankLayout.for_world(
            plan.world,
            plan._pipeline_ranks,
            tp_size=plan.tensor_parallel_size,
            sp_size=plan.sequence_parallel_size,
        )
        if plan.data_parallel != "fsdp":
            return layout
        return RankLayout(layout.pp_size, layout.dp_size, plan.shard_size, layout.tp_size, layout.sp_size)

    # ----------------------------------------------------------------------------- printing
    def label(self) -> str:
        """A short name: ``"single device"``, ``"ddp x4"``, ``"pp 2x2 1f1b m=8 +ac +zero"`` (pp x dp).

        Example::

            >>> ParallelPlan("ddp", devices=4).label()
            'ddp x4'
        """
        if self.strategy == "single_device":
            return "single device"
        if self.strategy == "ddp":
            return f"ddp x{self.devices}"
        v = f" v={self.stages_per_rank}" if (self.stages_per_rank or 1) > 1 else ""
        shape = f"{self._pipeline_ranks}x{self.data_parallel_size}"
        flags = "".join(technique.label(self) for technique in TECHNIQUES)
        return f"pp {shape} {self.schedule}{v} m={self.num_microbatches}{flags}"

    def strategy_arguments(self) -> dict[str, Any]:
        """The ``PipelineStrategy`` keywords that make this plan (those that differ from the defaults).

        Example::

            >>> ParallelPlan(pipeline_size=2, schedule="gpipe").strategy_arguments()
            {'pipeline_size': 2, 'schedule': 'gpipe'}
        """
        if self.strategy != "pipeline":
            raise ValueError(
                f"a {self.strategy!r} plan is not a PipelineStrategy: use Trainer(strategy="
                f"{'auto' if self.strategy == 'single_device' else 'ddp'!r}, devices={self.devices or 1})"
            )
        default = ParallelPlan()
        implied = 2 if self.schedule in V_SCHEDULES else 1  # (what the strategy implies by default)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in TRAINER_FIELDS or value == getattr(default, f.name):
                continue
            if f.name == "stages_per_rank" and value == implied:
                continue
            if f.name == "compile" and value == {"dynamic": True}:
                value = True
            if isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def code(self) -> str:
        """The ``PipelineStrategy(...)`` line that runs this plan (or the Trainer's strategy for DDP).

        Example::

            >>> ParallelPlan("ddp", devices=4).code()
            "Trainer(strategy='ddp', devices=4)"
        """
        if self.strategy == "ddp":
            return f"Trainer(strategy='ddp', devices={self.devices})"
        if self.strategy == "single_device":
            return "Trainer(devices=1)"
        arguments = ", ".join(f"{k}={_code_value(v)}" for k, v in self.strategy_arguments().items())
        return f"PipelineStrategy({arguments})"


# A misspelt field is a TypeError naming the closest valid one, as for every public class of the package.
ParallelPlan.__init__ = checks_options(ParallelPlan.__init__)  # type: ignore[method-assign]


def _code_value(value: Any) -> str:
    if callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    return repr(value)
