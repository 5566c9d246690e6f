"""PipelineStrategy: pipeline (x data x tensor) parallel training of an ordinary LightningModule.

Lightning glue only: the order of set-up, and Lightning's hooks mapped onto the mechanics, which know
nothing of Lightning: the plan (:mod:`lightning_parallel.plan`), the split and the schedules
(:mod:`lightning_parallel.pipeline` and the stage sources), the techniques
(:mod:`lightning_parallel.techniques`), the gradient synchronisation (:mod:`lightning_parallel.grads`).
Its other Lightning hooks are mixins, one concern each: the steps, ``backward`` and ``optimizer_step``
(``step_hooks.py``), the stop path (``stop.py``), collectives in a step (``collectives.py``), the data a
replica reads (``same_data.py``), checkpoints (``checkpointing.py``) and the release at exit
(``release.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.distributed.host_group import process_group_backend
from lightning_parallel.distributed.stop import DEFAULT_GRACE, StopGuard, check_grace
from lightning_parallel.grads.item_weights import ItemCount
from lightning_parallel.grads.sync import GradientSync
from lightning_parallel.layout.mesh import PipelineMesh
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.strategies.launcher import PipelineMultiProcessingLauncher
from lightning_parallel.strategies.pipeline import autoplan
from lightning_parallel.strategies.pipeline import setup as pipeline_setup
from lightning_parallel.strategies.pipeline.build import PipelineParts
from lightning_parallel.strategies.pipeline.checkpointing import PipelineCheckpointHooks
from lightning_parallel.strategies.pipeline.collectives import StepCollectives
from lightning_parallel.strategies.pipeline.meta_init import MetaInit
from lightning_parallel.strategies.pipeline.options import (
    OLDER_NAMES,
    PLAN_OPTIONS,
    plan_argument_docs,
    plan_from_options,
)
from lightning_parallel.strategies.pipeline.refusals import (
    check_fit_supported,
    refuse_disk_beside_auto,
    refuse_unsupported_callbacks,
)
from lightning_parallel.strategies.pipeline.release import ReleaseAtExit
from lightning_parallel.strategies.pipeline.same_data import SameData
from lightning_parallel.strategies.pipeline.script_launcher import StoppingScriptLauncher
from lightning_parallel.strategies.pipeline.step_hooks import PipelinedSteps
from lightning_parallel.strategies.pipeline.step_state import StepState
from lightning_parallel.strategies.pipeline.stop import StopAgreement, StopHooks, start_rank_guard
from lightning_parallel.techniques.compile import CompileWatch
from lightning_parallel.techniques.contract import Job, buffers_to
from lightning_parallel.techniques.recompute import Selection


class PipelineStrategy(
    PipelinedSteps,
    StopHooks,
    StepCollectives,
    SameData,
    MetaInit,
    ReleaseAtExit,
    PipelineCheckpointHooks,
    DDPStrategy,
):
    """Pipeline (x data) parallel training of an ordinary LightningModule on ``torch.distributed.pipelining``.

    The model is cut into stages, one (or more) per pipeline rank; world size = ``pipeline_size x``
    data-parallel replicas. How it is cut:

    * a module that holds its layers in one top-level ``nn.Sequential`` has that Sequential split
      between its children;
    * any other module (a GPT with ``nn.ModuleList`` blocks, embeddings, a head tied to the embedding)
      has its ``forward`` traced with torch.export and split at the blocks of its main ModuleList, or at
      ``split_points``. Weights used by several stages (tied) are replicated and kept identical.

    Each rank keeps only its own stage(s); the user's steps run unchanged (on the last stage, once per
    micro-batch in training), and what they log reaches the logger on global rank 0, the same on every
    rank. The ranks form one device mesh, ``strategy.device_mesh`` (``("pp", "dp_replicate",
    "dp_shard", "tp")``), built from the plan (``strategy.parallel_plan``, a
    :class:`~lightning_parallel.plan.parallel_plan.ParallelPlan`); after the split each stage gets
    the plan's techniques in torchtitan's order. The whole story: ``docs/pipeline.md``.

    Args:
        {plan_arguments}
        shard_optimizer_state: ``True`` is ``data_parallel="zero1"`` (the older name).
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"`` or ``"fork"`` (notebooks).
        stop_grace_period: seconds (or a ``timedelta``) from a stop signal to the end of every process.
            SIGTERM or SIGINT to the launcher, to every process of the job or to one rank stops the
            whole job: Lightning stops every rank at the next batch (``on_exception`` hooks run, e.g.
            a ``ModelCheckpoint(save_on_exception=True)`` save), a rank still running after this long
            (blocked in a collective) exits hard, and the exit status is 128 + the signal (143 for
            SIGTERM; SIGINT, Ctrl-C, takes Lightning's KeyboardInterrupt path: status 1). Ranks die with
            the process that launched them.
        num_stages: deprecated name of ``pipeline_size``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout: as for Lightning's ``DDPStrategy``. Its other options act
            on the DistributedDataParallel wrapper, which this strategy does not use: they are a
            TypeError, as is any unknown option (naming the closest valid one).

    Example::

        trainer = L.Trainer(accelerator="gpu", devices=8,
                            strategy=PipelineStrategy(pipeline_size=4, num_microbatches=8, schedule="1f1b"))
        trainer.fit(GPT(), datamodule)      # 4 pipeline stages x 2 data-parallel replicas

        # 8 devices: 2 stages, each sharded over 4 ranks with FSDP2 (ZeRO-3)
        PipelineStrategy(pipeline_size=2, data_parallel="fsdp")
        # ... or sharded over 2 ranks and replicated twice (HSDP)
        PipelineStrategy(pipeline_size=2, data_parallel="fsdp", data_parallel_shard_size=2)
        # 8 devices: 2 stages x 2 replicas x 2 tensor-parallel ranks (3-D)
        PipelineStrategy(pipeline_size=2, tensor_parallel_size=2)
        # 4 devices: 2 stages x each sequence split over 2 ranks (long context: Ulysses attention)
        PipelineStrategy(pipeline_size=2, sequence_parallel_size=2)
        # each stage's blocks compiled with torch.compile (inductor), after the split
        PipelineStrategy(pipeline_size=2, compile=True)
    """

    strategy_name = "pipeline"

    @checks_options
    def __init__(
        self,
        pipeline_size: int | None = None,
        num_microbatches: int = 4,
        schedule: str = "1f1b",
        stages_per_rank: int | None = None,
        partition: str | list[int] = "uniform",
        module_name: str | None = None,
        split_points: list[str] | None = None,
        activation_checkpointing: Selection = False,
        shard_optimizer_state: bool = False,
        data_parallel: Literal["replicate", "zero1", "fsdp"] | None = None,
        data_parallel_shard_size: int | None = None,
        overlap_gradient_reduction: bool = True,
        bucket_cap_mb: float = 25.0,
        parallelize_fn: Callable[[torch.nn.Module, DeviceMesh | None], Any] | None = None,
        save_distributed_checkpoint: bool = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: dict[str, Any] | None = None,
        sequence_parallel_size: int = 1,
        compile: bool | dict[str, Any] = False,
        offload: str | list[str] | None = None,
        offload_pin_memory: bool | None = None,
        offload_to: Literal["host", "disk"] = "host",
        offload_dir: str | None = None,
        offload_buffer: int | str | None = None,
        plan: Literal["auto"] | None = None,
        memory: str | int | None = None,
        host_memory: str | int | None = None,
        disk_memory: str | int | None = None,
        global_batch_size: int | None = None,
        trials: int | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        stop_grace_period: float | timedelta = DEFAULT_GRACE,
        timeout: timedelta | None = default_pg_timeout,
        num_stages: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        # The plan's options, by name, as this call received them: mapped onto the plan in one place.
        arguments = locals()
        options = {name: arguments[name] for name in (*PLAN_OPTIONS, *OLDER_NAMES)}
        refuse_disk_beside_auto(plan, offload_to)
        searched_dir = autoplan.searched_dir(plan, options)  # (plan="auto": the disk tier is searched there)
        self.parallel_plan = plan_from_options(options)
        auto = (memory, host_memory, global_batch_size, self.parallel_plan, trials, disk_memory, searched_dir)
        self._auto = autoplan.auto_request(plan, *auto)
        self.stop_grace_period = check_grace(stop_grace_period, "PipelineStrategy(stop_grace_period=...)")
        self._stop_guard: StopGuard | None = None  # the one this strategy started (not its launcher's)
        self._stop_agreement = StopAgreement()
        self.parts: PipelineParts | None = None  # this rank's pipeline, as the build made it
        self.step_state = StepState()  # what the steps carry between them (held gradients, the timeline)
        self._mesh: PipelineMesh | None = None
        self._item_count: ItemCount | None = None
        self._compile_watch: CompileWatch | None = None
        self._sync: GradientSync | None = None  # the optimizer step's gradient synchronisation
        self._job: Job | None = None  # this rank's job as the techniques saw it at set-up
        self._batch_transform: Callable[[Any], Any] | None = None  # the techniques' (a sequence's shard)
        self.planned: autoplan.AutoPlanned | None = None  # plan="auto": what rank 0 weighed (at setup)

    # ----------------------------------------------------------------------------------- layout
    @classmethod
    def from_plan(cls, plan: ParallelPlan, **kwargs: Any) -> PipelineStrategy:
        """The strategy that runs ``plan`` (a planner row, ``strategy.parallel_plan``); ``kwargs``: the
        launcher's options (``start_method``, ...). Example: ``PipelineStrategy.from_plan(choice.plan)``.
        """
        return cls(**plan.strategy_arguments(), **kwargs)

    @property
    def pipeline_size(self) -> int:
        return self.parallel_plan.pipeline_size or self.world_size

    @property
    def compile_seconds(self) -> float:
        """Seconds this rank spent in torch.compile so far (0 without ``compile``): apart from the steps.

        Each mode's first step (and a recompilation) compiles; the step figures that include it are the
        ones to leave out. Example: ``trainer.strategy.compile_seconds`` after ``fit``.
        """
        return self._compile_watch.seconds if self._compile_watch is not None else 0.0

    @property
    def layout(self) -> RankLayout:
        return self.parallel_plan.layout(self.world_size)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The torch ``DeviceMesh``: ``"pp"``, ``"dp_replicate"``, ``"dp_shard"``, ``"tp"`` (and ``"dp"``).

        Built in ``setup_environment``, as Lightning's ``ModelParallelStrategy`` does, so ``configure_model``
        can read it; ``None`` before, without a process group, or until ``plan="auto"`` chose (at setup).
        """
        return self._mesh.device_mesh if self._mesh is not None else None

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches (the sampler's ``num_replicas``)."""
        return self.layout.size("data")

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel_plan.tensor_parallel_size

    @property
    def plan(self) -> StagePlan | None:
        """The stage plan (which stage holds what, on which ranks), once the strategy is set up."""
        return self.parts.plan if self.parts is not None else None

    @property
    def mesh(self) -> PipelineMesh | None:
        return self.parts.mesh if self.parts is not None else self._mesh

    @property
    def data_parallel_group(self) -> Any:
        """The replicas of this rank's stage: what ``AllReducedMetrics`` reduces over (``"metrics"``)."""
        return self.parts.mesh.group("metrics") if self.parts is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard the data by replica: the stages (and tensor-parallel ranks) of one replica see the same batch.
        return {"num_replicas": self.data_parallel_size, "rank": self.layout.rank("data", self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            environment, processes, nodes = self.cluster_environment, self.num_processes, self.num_nodes
            self._launcher = StoppingScriptLauncher(environment, processes, nodes)
        else:
            self._launcher = PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        if self._lightning_module is not None and self._lightning_module._trainer is not None:
            refuse_unsupported_callbacks(self._lightning_module.trainer)  # before the callbacks' own setup
        if pipeline_setup.environment_of(self).host_backend:  # host tensors meet collectives
            backend = process_group_backend(self.root_device.type, self._process_group_backend)
            self._process_group_backend = backend
        super().setup_environment()
        if self._auto is None:  # the plan that runs knows its devices (plan="auto": the choice's, at setup)
            self.parallel_plan = self.parallel_plan.for_devices(self.world_size)
        if self._stop_guard is None:
            guard, launched = start_rank_guard(self, self.stop_grace_period)
            self._stop_guard = guard if launched else None
        if self._mesh is None:  # the one device mesh (a collective); plan="auto": after the choice, at setup
            self._mesh = autoplan.environment_mesh(self)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_fit_supported(trainer)
        first = self.parts is None
        if first:
            if self._auto is not None:  # plan="auto": chosen on rank 0, applied on every rank; the mesh
                autoplan.decide(self, trainer)
            self.parts, read = pipeline_setup.split(self, trainer, fitting)
            self._register_release()
        self.precision_plugin.convert_module(self.model)
        self.precision_plugin.convert_module(self.parts.twin)  # (in place, as for the model)
        self.model_to_device()
        if first:
            parallelized = pipeline_setup.parallelize(self, self.parts, read)
            self.parts, self._job, self._sync, self._compile_watch = parallelized
        if fitting:
            pipeline_setup.prepare_optimizers(self, trainer, self.parts, self._job)
        self.setup_precision_plugin()

    @override
    def teardown(self) -> None:
        pipeline_setup.release_optimizers(self, self._job)  # (the disk tier's scratch files)
        super().teardown()

    @override
    def model_to_device(self) -> None:
        if pipeline_setup.environment_of(self).parameters_on_host:  # (FSDP2's host shards)
            buffers_to(self.model, self.root_device)
        else:
            super().model_to_device()

    def weight_items_by(self, count: ItemCount | None) -> None:
        """Make each optimizer step's loss the mean over its items, as ``count(micro_batch)`` counts them.

        What :class:`~lightning_parallel.TokenWeightedLoss` calls at setup. Without it, a Hugging Face
        model whose loss the step takes from ``labels=`` is counted as that loss counts (automatic);
        any other step is weighted by samples.
        """
        if self.parts is not None:
            raise RuntimeError("weight_items_by must be called before the strategy's setup")
        self._item_count = count

    @property
    def weights_items(self) -> bool:
        """Whether training losses are item-weighted (token-exact) rather than sample-weighted."""
        return self.parts is not None and self.parts.items is not None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = [
            ("pipeline", "popen", "scripts, torchrun and SLURM"),
            ("pipeline_spawn", "spawn", "spawned processes (pytest, CPU)"),
            ("pipeline_notebook", "fork", "forked processes (Jupyter)"),
        ]
        for name, start_method, where in entries:
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"Pipeline parallelism for {where}", start_method=start_method
                )


PipelineStrategy.__doc__ = (PipelineStrategy.__doc__ or "").replace(
    "        {plan_arguments}", plan_argument_docs() + "\n" + autoplan.AUTO_ARGUMENT_DOCS
)
