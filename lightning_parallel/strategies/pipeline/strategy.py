"""PipelineStrategy: pipeline (x data) parallel training of an ordinary LightningModule.

Lightning glue only: the split, the schedules, the gradient collectives and the state mapping live
in :mod:`lightning_parallel.pipeline`, which knows nothing of Lightning.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_parallel._options import checks_options
from lightning_parallel.distributed.agree import failing_together
from lightning_parallel.distributed.collectives import all_gather_objects, broadcast_object
from lightning_parallel.distributed.stop import DEFAULT_GRACE, StopGuard, check_grace
from lightning_parallel.grads.item_weights import ItemCount, scale_gradients
from lightning_parallel.grads.reduce import all_reduce_gradients, clip_grad_norm_across
from lightning_parallel.pipeline.mesh import PipelineMesh, build_mesh
from lightning_parallel.pipeline.microbatches import batch_size
from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.plan.checks import Selection
from lightning_parallel.plan.layout import RankLayout
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.strategies.launcher import PipelineMultiProcessingLauncher
from lightning_parallel.strategies.pipeline.build import PipelineParts, build_pipeline
from lightning_parallel.strategies.pipeline.checkpointing import PipelineCheckpointHooks
from lightning_parallel.strategies.pipeline.items import step_items
from lightning_parallel.strategies.pipeline.loss_scale import install_loss_scaling
from lightning_parallel.strategies.pipeline.options import (
    OLDER_NAMES,
    PLAN_OPTIONS,
    plan_argument_docs,
    plan_from_options,
)
from lightning_parallel.strategies.pipeline.parallelize import (
    parallelize_parts,
    tensor_plan,
)
from lightning_parallel.strategies.pipeline.refusals import (
    check_fit_supported,
    refuse_compiled_module,
    refuse_unsupported_callbacks,
)
from lightning_parallel.strategies.pipeline.step import last_pp_rank, run_step
from lightning_parallel.strategies.pipeline.stop import (
    StopAgreement,
    StoppingScriptLauncher,
    keep_lightning_sigterm_handling,
    mark_stopped_exit,
    replace_lightning_stop_broadcast,
    start_rank_guard,
)
from lightning_parallel.strategies.pipeline.summary import summarize_before_split
from lightning_parallel.techniques import recompute, zero
from lightning_parallel.techniques.compile import CompileWatch
from lightning_parallel.techniques.fsdp import reduce_gradients
from lightning_parallel.timeline.recorder import Timeline, span_of


def _from_plan(name: str, doc: str) -> property:
    """A read-only attribute of the strategy that is its plan's setting (one home for each setting)."""
    return property(lambda self: getattr(self.parallel_plan, name), doc=doc)


class PipelineStrategy(PipelineCheckpointHooks, DDPStrategy):
    """Pipeline (x data) parallel training of an ordinary LightningModule on ``torch.distributed.pipelining``.

    The model is cut into stages, one (or more) per pipeline rank; world size = ``pipeline_size x``
    data-parallel replicas. How it is cut:

    * a module that holds its layers in one top-level ``nn.Sequential`` has that Sequential split
      between its children;
    * any other module (a GPT with ``nn.ModuleList`` blocks, embeddings, a head tied to the embedding)
      has its ``forward`` traced with torch.export and split at the blocks of its main ModuleList, or at
      ``split_points``. Weights used by several stages (tied) are replicated and kept identical.

    Each rank builds and keeps only its own stage(s); the user's ``training_step`` /
    ``validation_step`` / ``test_step`` / ``predict_step`` run unchanged (on the last stage, once per
    micro-batch in training); what they log, torchmetrics Metrics included, reaches the logger on global
    rank 0 and is the same on every rank. In a step, ``self.all_gather`` and the strategy's ``reduce``,
    ``broadcast`` and ``barrier`` run over the data-parallel ranks of the stage running it (the last
    stage's replicas, after the model call); a ``torch.distributed`` collective there over other ranks
    is refused on every rank, with the fix. Gradients are reduced over the data-parallel ranks once per
    optimizer step.

    The ranks form one device mesh, ``strategy.device_mesh``, with dimensions ``("pp",
    "dp_replicate", "dp_shard", "tp")``. After the split each stage module is parallelized on it:
    first tensor parallelism (``tensor_parallel_size``), then ``parallelize_fn(stage_module,
    device_mesh)`` if given, then ``torch.compile`` (``compile``), then the ``data_parallel`` mode
    (torchtitan's order; recomputation is installed before).

    Args:
        {plan_arguments}
        shard_optimizer_state: ``True`` is ``data_parallel="zero1"`` (the older name).
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"`` or ``"fork"`` (notebooks).
        stop_grace_period: seconds (or a ``timedelta``) from a stop signal to the end of every process.
            SIGTERM or SIGINT to the launcher, to every process of the job or to one rank stops the
            whole job: Lightning stops every rank at the next batch (``on_exception`` hooks run, e.g.
            a ``ModelCheckpoint(save_on_exception=True)`` save), a rank still running after this long
            (blocked in a collective) exits hard, and the exit status is 128 + the signal (143 for
            SIGTERM). Ranks die with the process that launched them.
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
        parallelize_fn: Callable[[torch.nn.Module, DeviceMesh | None], Any] | None = None,
        save_distributed_checkpoint: bool = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: dict[str, Any] | None = None,
        compile: bool | dict[str, Any] = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        stop_grace_period: float | timedelta = DEFAULT_GRACE,
        timeout: timedelta | None = default_pg_timeout,
        num_stages: int | None = None,
        # DDPStrategy's arguments that this strategy honours; the others (comm hooks, model averaging,
        # DistributedDataParallel's kwargs) act on the DDP wrapper, which it never builds.
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
        self.parallel_plan = plan_from_options(
            {name: arguments[name] for name in (*PLAN_OPTIONS, *OLDER_NAMES)}
        )
        self.stop_grace_period = check_grace(stop_grace_period, "PipelineStrategy(stop_grace_period=...)")
        self._stop_guard: StopGuard | None = None  # the one this strategy started (not its launcher's)
        self._stop_agreement = StopAgreement()
        self.parts: PipelineParts | None = None
        self._mesh: PipelineMesh | None = None
        self._release_registered = False
        self._first_batch_checked = False
        self._tensor_plan: Any = None
        self._item_count: ItemCount | None = None
        self._compile_watch: CompileWatch | None = None

    # ----------------------------------------------------------------------------------- layout
    @classmethod
    def from_plan(cls, plan: ParallelPlan, **kwargs: Any) -> PipelineStrategy:
        """The strategy that runs ``plan`` (a planner row, or ``strategy.parallel_plan``); ``kwargs``:
        the launcher's options (``start_method``, ``stop_grace_period``, ...).

        Example::

            best = rank_plans(facts, candidate_plans(4, 10, 32), 32)[0]
            trainer = L.Trainer(devices=4, strategy=PipelineStrategy.from_plan(best.plan))
        """
        return cls(**plan.strategy_arguments(), **kwargs)

    @property
    def pipeline_size(self) -> int:
        return self.parallel_plan.pipeline_size or self.world_size

    num_microbatches = _from_plan("num_microbatches", "Micro-batches per batch.")
    schedule = _from_plan("schedule", "The torch schedule's name.")
    stages_per_rank = _from_plan("stages_per_rank", "Stages per pipeline rank.")
    partition = _from_plan("partition", "How the stages are balanced.")
    activation_checkpointing = _from_plan("activation_checkpointing", "Which units recompute in backward.")
    shard_optimizer_state = _from_plan(
        "shard_optimizer_state", "Whether optimizer state is sharded (ZeRO-1)."
    )
    data_parallel = _from_plan("data_parallel", "replicate, zero1 or fsdp.")
    save_distributed_checkpoint = _from_plan(
        "save_distributed_checkpoint", "Whether checkpoints are DCP dirs."
    )

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

        Built in ``setup_environment``, as Lightning's ``ModelParallelStrategy`` does, so
        ``configure_model`` can read it; ``None`` before, or without a process group.
        """
        return self._mesh.device_mesh if self._mesh is not None else None

    @property
    def data_parallel_size(self) -> int:
        return self.layout.dp_size

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
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The replicas of this rank's stage (metrics and gradients are reduced over it)."""
        return self.parts.mesh.dp_group if self.parts is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard the data by replica: the stages (and tensor-parallel ranks) of one replica see the same batch.
        return {"num_replicas": self.data_parallel_size, "rank": self.layout.coordinates(self.global_rank)[1]}

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
        super().setup_environment()
        if self._stop_guard is None:
            guard, launched = start_rank_guard(self, self.stop_grace_period)
            self._stop_guard = guard if launched else None
        if self._mesh is None:  # the one device mesh: every rank builds it (a collective)
            self._mesh = build_mesh(self.root_device.type, self.layout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            check_fit_supported(trainer)
        first = self.parts is None
        if self.parts is None:
            refuse_compiled_module(self.lightning_module)  # (every rank holds the same module)
            if trainer.state.fn == TrainerFn.FITTING:
                summarize_before_split(trainer, self.lightning_module, self)  # the whole model's table
            with failing_together():
                self._tensor_plan = tensor_plan(self.lightning_module, self.parallel_plan)
            self.parts = build_pipeline(
                self.parallel_plan, trainer, self.lightning_module, self.layout, self.root_device, self._mesh
            )
            naming = self.parts.glue.naming
            every_unit = [naming.prefix + u for stage in self.parts.plan.stages for u in stage.units]
            selection = self.parallel_plan.activation_checkpointing
            recompute.apply(self.parts.runner.stages, selection, naming, every_unit)
            self.parts.items = step_items(self.lightning_module, self.parts.call, self._item_count)
            schedule, table = self.parallel_plan.schedule, self.parts.plan.format_table()
            rank_zero_info(f"PipelineStrategy stage plan ({schedule}):\n{table}")
            self._register_release()
        self.precision_plugin.convert_module(self.model)
        if self.parts.twin is not None:
            self.parts.twin = self.precision_plugin.convert_module(self.parts.twin)
        self.model_to_device()
        if first:  # split, recomputation, then tp, compile, the data-parallel sharding (torchtitan's order)
            parallelize_parts(self.parts, self.parallel_plan, self.lightning_module, self._tensor_plan)
            if self.parallel_plan.compile is not None:
                self._compile_watch = CompileWatch(rank_zero_warn)
                self._compile_watch.start()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.parallel_plan.shard_optimizer_state:  # ZeRO-1 over the replicas of each stage
                schedulers = [config.scheduler for config in self.lr_scheduler_configs]
                self.optimizers = zero.apply(self.optimizers, schedulers, self.parts.mesh.dp_group)
                replicas = self.parts.mesh.dp_size
                rank_zero_info(
                    f"PipelineStrategy: optimizer state sharded over {replicas} replica(s) per stage"
                )
            _optimizers_to_device(self.optimizers, self.root_device)
            self._install_global_clipping()
            install_loss_scaling(self.precision_plugin, self.optimizers)  # 16-mixed: one skip decision
        self.setup_precision_plugin()

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

    def _register_release(self) -> None:
        if not self._release_registered:
            # Runs before Lightning's own atexit destroy (handlers run last-registered first).
            atexit.register(_release_at_exit, weakref.ref(self))
            self._release_registered = True

    def _release_process_groups(self) -> None:
        """At interpreter exit: drop the stages, schedules and mesh, then destroy the process group.

        Left alive into interpreter finalisation, gloo process groups referenced from these objects
        were destroyed after the runtime they need, and 1 in 16 script runs ended in SIGABRT
        ("terminate called without an active exception") after a successful job.
        """
        if self.parts is not None:
            self.parts.runner.clear()
        if self._compile_watch is not None:
            self._compile_watch.stop()
        self.parts = self._mesh = None
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _install_global_clipping(self) -> None:
        # Lightning's Precision.clip_grad_by_norm clips by this rank's norm only; a stage holds a
        # slice of the model, so the norm must be reduced over the pipeline. No public hook exists
        # below configure_gradient_clipping, hence this instance-level override (Lightning 2.6.6).
        parts, plugin = self.parts, self.precision_plugin
        assert parts is not None

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            params = plugin.main_params(optimizer)
            clip_grad_norm_across(
                params, float(clip_val), parts.mesh.pp_group, not_counted=parts.shared.not_counted
            )

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # ------------------------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._stop_agreement.at_batch(self.lightning_module.trainer)  # a stop signal to any rank stops all
        with self.precision_plugin.train_step_context():
            return self._pipelined_step("training_step", args, train=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._pipelined_step("validation_step", args, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._pipelined_step("test_step", args, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._pipelined_step("predict_step", args, train=False)

    def _pipelined_step(self, step_name: str, args: tuple[Any, ...], train: bool) -> Any:
        assert self.parts is not None
        if train and not self._first_batch_checked:
            # Later batches may be short (an epoch's last); the first one shows the configured size.
            self._first_batch_checked = True
            n, m = batch_size(args[0]), self.parallel_plan.num_microbatches
            if n < m:
                raise ValueError(
                    f"a training batch of {n} samples cannot feed num_microbatches={m}: use a per-replica "
                    f"batch size of at least {m} (ideally a multiple of it), or fewer micro-batches"
                )
        watch = self._compile_watch
        before = watch.seconds if watch is not None else 0.0
        out = run_step(self.parts, self.lightning_module, step_name, args, train)
        if watch is not None and watch.seconds > before:
            rank_zero_info(
                f"PipelineStrategy: torch.compile took {watch.seconds - before:.1f} s in this {step_name} "
                f"(batch {args[1] if len(args) > 1 else '?'}; {watch.seconds:.1f} s in all on this rank), "
                f"counted apart from the steps as trainer.strategy.compile_seconds"
            )
        return out

    # ------------------------------------------------------------------ collectives in a step
    def _step_group(self, group: Any) -> Any:
        """In the user's step, the default (world) group means the step's data-parallel ranks.

        Only the stage running the step's code reaches a collective there: its data-parallel ranks
        (the last stage's, after the model call) are the ranks that can meet in it.
        """
        parts = self.parts
        if parts is None or not parts.scope.active or not (group is None or group is dist.group.WORLD):
            return group
        return parts.mesh.dp_group

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return super().all_gather(tensor, group=self._step_group(group), sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return super().reduce(tensor, group=self._step_group(group), reduce_op=reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        group = self._step_group(None)
        if group is None:
            return super().barrier(*args, **kwargs)
        dist.barrier(group=group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        group = self._step_group(None)
        if group is None:
            return super().broadcast(obj, src)
        return broadcast_object(obj, src=dist.get_global_rank(group, src), group=group)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        mark_stopped_exit(exception)  # a stop ends with 128 + the signal, not Lightning's status 0
        # Under the script launcher the ranks this process started may be blocked on it in a
        # point-to-point receive (with NCCL until the process-group timeout): end them now, so
        # the job stops with this rank's error. Lightning does the same on KeyboardInterrupt. A
        # stop signal stops them at the same batch as this rank (their own hooks still run).
        stopped = isinstance(exception, SIGTERMException)
        if isinstance(self.launcher, _SubprocessScriptLauncher) and not stopped:
            self.launcher.kill(_get_sigkill_signal())

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        keep_lightning_sigterm_handling(self.lightning_module.trainer)
        replace_lightning_stop_broadcast(self.lightning_module.trainer)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._stop_agreement.finish()  # (every rank posted it: the training loop ran the same batches)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        keep_lightning_sigterm_handling(self.lightning_module.trainer)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        keep_lightning_sigterm_handling(self.lightning_module.trainer)

    @override
    def teardown(self) -> None:
        super().teardown()
        guard, self._stop_guard = self._stop_guard, None
        if guard is not None:
            guard.stop()  # a deadline a stop signal armed stays armed

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        keep_lightning_sigterm_handling(self.lightning_module.trainer)
        parts = self.parts
        if parts is not None and parts.mesh.dp_size > 1:
            # How many batches each replica predicts (the sampler does not pad): rank 0 must know
            # which replicas send it predictions at each step.
            counts = all_gather_objects(int(sum(self.lightning_module.trainer.num_predict_batches)))
            last = last_pp_rank(parts)
            parts.predict_batches = [
                counts[parts.mesh.global_rank(last, r)] for r in range(parts.mesh.dp_size)
            ]

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule already ran backward for every micro-batch inside training_step: add the
        # gradients it held aside, between Lightning's before/after-backward hooks.
        assert self.lightning_module is not None and self.parts is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.parts.held.add_to_grads()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        parts = self.parts
        assert parts is not None

        timeline = parts.timeline if parts.timeline is not None and parts.timeline.recording else None
        synced: list[int] = []

        def closure_then_sync() -> Any:
            result = closure()
            # Once per optimizer step, before clipping and the step itself: the tied weights'
            # replicas sum their gradients, then every stage averages over its replicas.
            with span_of(timeline, "gradient sync", "collective"):
                reduce_gradients(parts.sharded)  # FSDP2 stages: one reduce-scatter for the whole window
                parts.shared.sum_gradients()
                fsdp_params = [p for root in parts.sharded for p in root.parameters()]
                all_reduce_gradients(
                    self.lightning_module.parameters(), parts.mesh.dp_group, skip=fsdp_params
                )
                if parts.items is not None:  # the step's token mean over every replica
                    factor = parts.items.window.gradient_factor(parts.mesh.dp_size)
                    scale_gradients(self.lightning_module.parameters(), factor)
            synced.append(Timeline.now())
            return result

        out = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        if timeline is not None and synced:  # clipping (a pipeline all-reduce of the norm) and the step
            timeline.add("optimizer step", "optimizer", synced[-1], Timeline.now())
        return out

    # ----------------------------------------------------------------------- meta-device init
    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # With empty_init=True the model is built on the meta device: each rank then materialises
        # only its own stage at the split, so no rank ever holds the whole model.
        if empty_init:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):
            yield

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


def _release_at_exit(strategy_ref: weakref.ref) -> None:
    strategy = strategy_ref()  # a weak reference: registering must not keep the model alive
    if strategy is not None:
        strategy._release_process_groups()


PipelineStrategy.__doc__ = (PipelineStrategy.__doc__ or "").replace(
    "        {plan_arguments}", plan_argument_docs()
)
