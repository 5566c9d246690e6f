"""PipelineStrategy: pipeline (x data) parallel training of an ordinary LightningModule.

Lightning glue only: the split, the schedules, the gradient collectives and the state mapping live
in :mod:`lightning_parallel.pipeline`, which knows nothing of Lightning.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_parallel.pipeline import state as stage_state
from lightning_parallel.pipeline.grads import all_reduce_gradients, clip_grad_norm_across
from lightning_parallel.pipeline.mesh import PipelineMesh, build_mesh, check_world
from lightning_parallel.pipeline.partition import PARTITION_METHODS
from lightning_parallel.pipeline.plan import StagePlan
from lightning_parallel.pipeline.proxy import PipelinedSequential
from lightning_parallel.pipeline.recompute import Selection, check_selection
from lightning_parallel.pipeline.runner import PipelineRunner, is_multi_stage, schedule_class
from lightning_parallel.pipeline.split import find_sequential, split
from lightning_parallel.pipeline.zero import consolidate
from lightning_parallel.strategies._pipeline_memory import (
    checkpoint_stages,
    checkpointed_layers,
    shard_optimizers,
)
from lightning_parallel.strategies._pipeline_setup import plan_for_module
from lightning_parallel.strategies._pipeline_step import batch_size, run_step
from lightning_parallel.strategies.launcher import PipelineMultiProcessingLauncher


class PipelineStrategy(DDPStrategy):
    """Split the module's ``nn.Sequential`` into stages, one (or more) per rank, run by a torch schedule.

    World size = ``num_stages x`` data-parallel replicas. Each rank builds and keeps only its own
    stage(s); the user's ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step``
    run unchanged (on the last stage, once per micro-batch in training); what they log reaches the
    logger on global rank 0. Gradients are all-reduced over the replicas once per optimizer step.

    Args:
        num_stages: pipeline ranks per replica (default: all devices form one pipeline); with
            ``stages_per_rank`` > 1 the model is cut into ``num_stages x stages_per_rank`` stages.
        num_microbatches: micro-batches per batch (a batch it does not divide uses the largest
            divisor of its size: equal micro-batches, exact mean loss).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"`` or
            ``"interleaved_zero_bubble"`` (the schedules of ``torch.distributed.pipelining``).
        stages_per_rank: stages each rank runs (> 1 for the interleaved and looped schedules).
        partition: ``"uniform"`` (layer counts), ``"parameters"`` (balanced parameter counts),
            ``"time"`` (balanced forward+backward time measured on the first batch), or a list of
            layer counts per stage.
        module_name: the attribute holding the ``nn.Sequential`` (default: the module's only one).
        activation_checkpointing: recompute layers in backward instead of keeping their activations:
            ``True`` (every layer), a list of layer paths (``["layers.1", "layers.2"]``) or a callable
            ``(path, layer) -> bool``. Numbers are unchanged; the activation memory of a stage falls.
        shard_optimizer_state: shard each stage's optimizer state over the stage's replicas (ZeRO-1,
            torch's ``ZeroRedundancyOptimizer``); checkpoints still hold the full state.
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"`` or ``"fork"`` (notebooks).

    Example::

        trainer = L.Trainer(accelerator="gpu", devices=8,
                            strategy=PipelineStrategy(num_stages=4, num_microbatches=8, schedule="1f1b"))
        trainer.fit(LM(), datamodule)      # 4 stages x 2 data-parallel replicas
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        num_stages: int | None = None,
        num_microbatches: int = 4,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        partition: str | list[int] = "uniform",
        module_name: str | None = None,
        activation_checkpointing: Selection = False,
        shard_optimizer_state: bool = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(start_method=start_method, timeout=timeout, **kwargs)
        cls = schedule_class(schedule)
        _check_positive_int("num_microbatches", num_microbatches)
        _check_positive_int("stages_per_rank", stages_per_rank)
        if num_stages is not None:
            _check_positive_int("num_stages", num_stages)
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
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.stages_per_rank = stages_per_rank
        self.partition = partition
        self.module_name = module_name
        # --- memory options (issue 15) ---
        check_selection(activation_checkpointing)
        self.activation_checkpointing = activation_checkpointing
        self.shard_optimizer_state = bool(shard_optimizer_state)
        self.plan: StagePlan | None = None
        self.mesh: PipelineMesh | None = None
        self._runner: PipelineRunner | None = None
        self._proxy: PipelinedSequential | None = None
        self._param_names: dict[torch.nn.Parameter, str] = {}
        self._model_param_order: list[str] = []
        self._model_keys: list[str] = []
        self._held_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        self._first_batch_checked = False
        self._release_registered = False
        self._predict_batches: list[int] | None = None

    # ----------------------------------------------------------------------------------- layout
    @property
    def pipeline_size(self) -> int:
        return self.num_stages or self.world_size

    @property
    def data_parallel_size(self) -> int:
        return check_world(self.world_size, self.pipeline_size)

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The replicas of this rank's stage (metrics and gradients are reduced over it)."""
        return self.mesh.dp_group if self.mesh is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard the data by replica: the stages of one replica must see the same batch.
        dp_rank = self.global_rank % self.data_parallel_size
        return {"num_replicas": self.data_parallel_size, "rank": dp_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _check_fit_supported(trainer, self)
        if self._runner is None:
            self._split(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.shard_optimizer_state:  # memory (issue 15): ZeRO-1 over the stage's replicas
                shard_optimizers(self)
            _optimizers_to_device(self.optimizers, self.root_device)
            self._install_global_clipping()
        self.setup_precision_plugin()

    def _split(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        seq_name, seq = find_sequential(module, self.module_name)
        pp = self.pipeline_size
        if pp * self.stages_per_rank > len(seq):
            # Checked before any collective so every rank raises the same error.
            raise ValueError(
                f"num_stages x stages_per_rank ({pp} x {self.stages_per_rank}) is larger than the number of "
                f"layers in `{seq_name}` ({len(seq)}): use fewer stages or split the model into more layers"
            )
        recomputed = checkpointed_layers(seq_name, seq, self.activation_checkpointing)  # memory (issue 15)
        dp = self.data_parallel_size
        self.mesh = build_mesh(self.root_device.type, pp, dp)
        self._model_keys = list(module.state_dict().keys())
        self._model_param_order = [n for n, _ in module.named_parameters()]
        self.plan = plan_for_module(self, trainer, module, seq_name, seq)
        rank_zero_info(f"PipelineStrategy stage plan ({self.schedule}):\n{self.plan.format_table()}")
        self._proxy, stage_modules, indices = split(
            module, seq_name, seq, self.plan, self.mesh.pp_rank, self.root_device
        )
        checkpoint_stages(stage_modules, seq_name, recomputed)  # memory (issue 15)
        self._param_names = {p: n for n, p in module.named_parameters()}
        if not self._release_registered:
            # Runs before Lightning's own atexit destroy (handlers run last-registered first).
            atexit.register(_release_at_exit, weakref.ref(self))
            self._release_registered = True
        self._runner = PipelineRunner(
            stage_modules,
            indices,
            self.plan.num_stages,
            self.root_device,
            self.mesh.pp_group,
            self.schedule,
            self.num_microbatches,
        )

    def _release_process_groups(self) -> None:
        """At interpreter exit: drop the stages, schedules and mesh, then destroy the process group.

        Left alive into interpreter finalisation, gloo process groups referenced from these objects
        were destroyed after the runtime they need, and 1 in 16 script runs ended in SIGABRT
        ("terminate called without an active exception") after a successful job.
        """
        if self._runner is not None:
            self._runner.clear()
        self.mesh = None
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _install_global_clipping(self) -> None:
        # Lightning's Precision.clip_grad_by_norm clips by this rank's norm only; a stage holds a
        # slice of the model, so the norm must be reduced over the pipeline. No public hook exists
        # below configure_gradient_clipping, hence this instance-level override (Lightning 2.6.6).
        group = self.mesh.pp_group if self.mesh is not None else None
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            clip_grad_norm_across(plugin.main_params(optimizer), float(clip_val), group)

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # ------------------------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
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
        if train and not self._first_batch_checked:
            # Later batches may be short (an epoch's last); the first one shows the configured size.
            self._first_batch_checked = True
            n = batch_size(args[0])
            if n < self.num_microbatches:
                raise ValueError(
                    f"a training batch of {n} samples cannot feed num_microbatches={self.num_microbatches}: "
                    f"use a per-replica batch size of at least {self.num_microbatches} (ideally a multiple "
                    f"of it), or fewer micro-batches"
                )
        return run_step(self, step_name, args, train)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Under the script launcher the ranks this process started may be blocked on it in a
        # point-to-point receive (with NCCL until the process-group timeout): end them now, so
        # the job stops with this rank's error. Lightning does the same on KeyboardInterrupt.
        if isinstance(self.launcher, _SubprocessScriptLauncher):
            self.launcher.kill(_get_sigkill_signal())

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._predict_batches = None
        if self.mesh is not None and self.mesh.dp_size > 1:
            # How many batches each replica predicts (the sampler does not pad): rank 0 must know
            # which replicas send it predictions at each step.
            counts: list[Any] = [None] * self.world_size
            dist.all_gather_object(counts, int(sum(self.lightning_module.trainer.num_predict_batches)))
            last = self.mesh.pp_size - 1
            self._predict_batches = [counts[self.mesh.global_rank(last, r)] for r in range(self.mesh.dp_size)]

    @contextmanager
    def _grads_held_for_backward(self) -> Generator[None, None, None]:
        """Keep the gradients the schedule computes aside until Lightning's backward call.

        The schedule runs backward inside training_step, but Lightning zeroes the gradients between
        training_step and backward (on the first batch of each accumulation window). Holding this
        batch's gradients aside and adding them in :meth:`backward` keeps Lightning's order exact.
        """
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self._held_grads = [(p, p.grad) for p in params]
            for p, g in zip(params, earlier):
                p.grad = g

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule already ran backward for every micro-batch inside training_step: add the
        # gradients it held aside, between Lightning's before/after-backward hooks.
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        for p, g in self._held_grads:
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._held_grads = []
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            result = closure()
            # One all-reduce per stage per optimizer step, before clipping and the step itself.
            all_reduce_gradients(self.lightning_module.parameters(), self.data_parallel_group)
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    # ------------------------------------------------------------------------------ state dicts
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit module's state dict on global rank 0 (replica 0's stages send theirs there)."""
        local = self.lightning_module.state_dict()
        if self.mesh is None or self.mesh.pp_size == 1 or not _distributed_is_initialized():
            return local
        if self.mesh.dp_rank != 0:
            return {}
        parts = stage_state.gather_to(stage_state.to_cpu(dict(local)), 0, self.mesh.pp_group)
        if parts is None:
            return {}
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged[k] for k in self._model_keys if k in merged}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self.mesh is None or not self._param_names:
            return optimizer.state_dict()
        consolidate(optimizer)  # memory (issue 15): ZeRO gathers on replica 0; every replica calls it
        if self.mesh.dp_rank != 0:
            return {}
        named = stage_state.named_optimizer_state(optimizer, self._param_names)
        parts = stage_state.gather_to(named, 0, self.mesh.pp_group)
        return stage_state.merge_optimizer_states(parts) if parts is not None else {}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load after the split: each rank takes only its stage's keys, and a model built on the
        # meta device is materialised before the weights arrive.
        return True

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        full = checkpoint["state_dict"]
        if strict and self._model_keys:
            stage_state.check_keys(self._model_keys, full, type(self.lightning_module).__name__)
        local_keys = self.lightning_module.state_dict().keys()
        self.lightning_module.load_state_dict(
            {k: v for k, v in full.items() if k in local_keys}, strict=strict
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer states but configure_optimizers returned "
                f"{len(self.optimizers)}: resume with the same optimizers"
            )
        for optimizer, full in zip(self.optimizers, states):
            local = stage_state.reshard_optimizer_state(
                full, optimizer, self._param_names, self._model_param_order
            )
            optimizer.load_state_dict(local)
        _optimizers_to_device(self.optimizers, self.root_device)

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


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_fit_supported(trainer: pl.Trainer, strategy: PipelineStrategy) -> None:
    if not trainer.lightning_module.automatic_optimization:
        raise RuntimeError(
            "PipelineStrategy runs forward and backward inside its schedule and supports automatic "
            "optimization only: remove `self.automatic_optimization = False` (manual optimization is "
            "not supported)"
        )
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "PipelineStrategy does not support precision='16-mixed' (its GradScaler scales the loss outside "
            "the schedule): use 'bf16-mixed', 'bf16-true' or '32-true'"
        )
