"""Canaries: each torch (or Lightning) fault this package works around, shown on a tiny case of its own.

Every canary asserts what torch *should* do and is ``xfail(strict=True)``: it fails today, so the
workaround is needed. The day the fault is fixed the canary passes, strict xfail turns that into a
failure, and the workaround (named in the reason, with its upstream issue) can be deleted on evidence.

The workaround's code carries a comment naming its canary, so whoever deletes one finds the other::

    # torch workaround: https://github.com/pytorch/pytorch/issues/N
    #   canary: test_torch_does_what_it_should

(``Lightning workaround:`` for Lightning's faults; ``no upstream issue found`` in place of a link where a
search found none, the reason then saying what was searched and when.) A canary's reason gives the link,
the fault, and the files (by name: folders move) and functions that work around it.
:func:`test_every_workaround_marker_has_its_canary_and_every_canary_its_marker` holds the two together.

Worked around or relied on, without a canary, and why:

* ``compile.py`` (``check_compile``): compiling tensor-parallel blocks recursed without end in
  AOTAutograd at 2 tensor-parallel ranks; on one rank it compiles fine, and a canary with two ranks and a
  compile costs tens of seconds on 2 CPU cores. No upstream issue found.
* ``launcher.py`` (``os._exit`` at the end of a worker) and ``strategy.py`` (``_release_process_groups``
  at exit): gloo objects destroyed during interpreter teardown abort 1 run in 16-20 ("terminate called
  without an active exception"); a fault that rare cannot make a canary fail on demand.
* ``runner.py``: GPipe for 1F1B with fewer micro-batches than stages, ZBV for DualPipeV, ``scale_grads=
  False``: torch's stated requirements and a choice of ours (the loss is scaled instead), not faults.
* torch's private names used on purpose where torch has no public one; where one moves, the code or a
  test fails loudly (``_torch_hooks.py``, ``_v_forward.py``'s runtime, ``mesh.py``'s ``_flatten``,
  ``torch.utils._pytree``, ``fsdp/_internals.py``, ``planner/schedule.py``'s stand-in stages,
  ``_CustomReducer``, ``Pipe._from_traced``, ``InterpreterModule._run_with_interpreter`` (speed),
  ``GradScaler``'s per-optimizer state, ``sharded.py``'s scheduler retargeting, ``CompileWatch``'s reading of
  dynamo's log): not faults.
* Designs, not workarounds: dynamic sizes in traced stages (``symbolic_sizes.py``: ``pipeline()`` exports
  static shapes only, by design), manual ``PipelineStage`` for traced stages, ``distributed.py``'s own
  optimizer-state layout (tied weights' canonical names), ``grads/reduce.py``'s handling of ``_StridedShard``.
* Lightning's and torchmetrics' private state (accumulation windows, checkpoint and metrics internals,
  ``ModelSummary``'s ``_summary``, loops' ``_data_source``, ``_make_zero_grad_fn``,
  ``_collect_rank_zero_results``, the clip override, the per-batch SIGTERM broadcast, ``_forward_cache``):
  no public hook exists, which is not a fault; each is checked by a test that fails loudly if it moves.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import signal
import subprocess
import sys
import textwrap
import tokenize
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)
from torch.distributed.pipelining._IR import _modify_graph_op_device

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch.export, inside torch

CPU = torch.device("cpu")


def _stages(*modules: nn.Module, **kwargs) -> list[PipelineStage]:
    """Manual stages for ``modules``, all on this one rank (the stages of one V, or of one loop)."""
    return [
        PipelineStage(m, i, len(modules), CPU, group=dist.group.WORLD, **kwargs)
        for i, m in enumerate(modules)
    ]


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


# --- tracing: torch.export and the pipeline frontend ------------------------------------------------


class Rotary(nn.Module):
    """A rotary table computed under no_grad, as the Hugging Face decoders' rotary embeddings are."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", torch.ones(4))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * self.inv[None, :]
        return angles.cos(), angles.sin()


class RotaryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cos, sin):
        return self.lin(x) * cos + sin


class RotaryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rot, self.blocks = Rotary(), nn.ModuleList([RotaryBlock(), RotaryBlock()])

    def forward(self, x):
        cos, sin = self.rot(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


@pytest.mark.xfail(
    strict=True,
    reason="https://github.com/pytorch/pytorch/issues/184361: pipeline() outlines a no-grad region's output "
    "twice; worked around by graph_regions.py (inline_wrapped_regions)",
)
def test_torch_pipeline_splits_a_model_whose_no_grad_region_feeds_a_later_stage():
    torch.manual_seed(0)
    model, x = RotaryModel(), torch.randn(2, 3, 4)
    pipe = pipeline(model, (x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    out = pipe.split_gm(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched '_modify_graph_op_device positional device argument not "
    "moved build_stage' on 2026-12-03): torch's _modify_graph_op_device (Pipe.build_stage) rewrites "
    "device= keywords only, not a device given positionally (x.to(h.device)); worked around by trace.py "
    "(device_args_as_keywords)",
)
def test_torch_moves_a_positional_device_of_a_stage_graph():
    graph = fx.Graph()
    x = graph.placeholder("x")
    moved = graph.call_function(torch.ops.aten.to.device, (x, torch.device("meta"), torch.float32))
    graph.output(moved)
    gm = fx.GraphModule(nn.Module(), graph)
    _modify_graph_op_device(gm, CPU)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert torch.device("meta") not in [*node.args, *node.kwargs.values()]


class RootReader(nn.Module):
    """The second stage reads an input of forward (a padding mask, labels) beside its neighbour's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x)) + x


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="https://github.com/pytorch/pytorch/issues/127964 (skip connections in pipelining): torch's "
    "traced stages cannot receive a root input of forward after stage 0 ('expected non-root _RecvInfo but "
    "got root arg'); worked around by relay.py (relay_skips)",
)
def test_torch_traced_stages_give_a_later_stage_an_input_of_forward(one_rank):
    model, x = RootReader(), torch.randn(2, 4)
    pipe = pipeline(model, (x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    stage = pipe.build_stage(1, CPU, dist.group.WORLD)
    stage._prepare_forward_infra(1, None, has_backward=True)  # private, torch 2.13: the stage's set-up
    stage._retrieve_recv_activations(0)  # what the stage's first forward runs


class SkipReader(nn.Module):
    """The third stage reads the first stage's output beside its neighbour's (as a mask made early)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        h = self.blocks[0](x)
        return self.blocks[2](self.blocks[1](h)) + h


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="https://github.com/pytorch/pytorch/issues/127964 (skip connections in pipelining): a traced "
    "stage whose output two later stages read cannot run backward ('Backward of skip connections not "
    "supported yet'); worked around by relay.py (relay_skips)",
)
def test_torch_traced_stages_run_backward_of_a_value_read_past_the_next_stage(one_rank):
    x = torch.randn(2, 4)
    pipe = pipeline(SkipReader(), (x,), split_spec={f"blocks.{i}": SplitPoint.BEGINNING for i in (1, 2)})
    stage = pipe.build_stage(0, CPU, dist.group.WORLD)
    stage.has_backward = True  # what a schedule with a loss sets
    stage._prepare_forward_infra(1, (x,), None, has_backward=True)  # private, torch 2.13: the set-up
    stage._prepare_backward_infra(1)


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'isinstance(treespec, LeafSpec) is deprecated FutureWarning "
    "torch.export pipeline deepcopy' on 2026-12-03; pytorch PRs 167470 and 169421 fixed other call sites): "
    "pipeline() warns about torch's own deprecated LeafSpec on every trace; worked around by trace.py "
    "(trace, a warnings filter)",
)
def test_torch_pipeline_warns_nothing_about_its_own_pytree_internals():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline(TwoBlocks(), (torch.randn(2, 4),), split_spec={"blocks.1": SplitPoint.BEGINNING})
    assert not [w for w in caught if "LeafSpec" in str(w.message)]


# --- schedules and stages ----------------------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'pipelining shape inference calls loss_fn extra time dummy "
    "output' on 2026-12-03): torch 2.13 infers a manual PipelineStage's shapes at its first step by "
    "calling loss_fn once more, on a dummy output; worked around by runner.py (_metadata_call_pending) and "
    "by giving the stages their shapes (stage_shapes.py, StageShapes)",
)
def test_torch_schedules_call_loss_fn_once_per_micro_batch_when_they_infer_shapes(one_rank):
    calls = []

    def loss_fn(output, target):
        calls.append(int(target.numel()))
        return output.sum()

    (stage,) = _stages(nn.Linear(4, 4))
    schedule = ScheduleGPipe(stage, 2, loss_fn=loss_fn, scale_grads=False)
    schedule.step(torch.randn(4, 4), target=torch.zeros(4))
    assert len(calls) == 2, calls


class Ids(nn.Module):
    """Sends its output and a mask of ones, which the next stage relies on (as labels or token ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), torch.ones_like(x)


class MaskReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, mask):
        if not bool((mask == 1).all()):  # what an embedding lookup with these values would trip on
            raise ValueError("the stage ran on values its neighbour never sent")
        return self.lin(h) * mask


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="no upstream issue found (searched 'pipelining metadata inference forward on empty uninitialized "
    "tensors index out of range' on 2026-12-03): a manual stage that infers its shapes runs its forward "
    "once on uninitialised inputs; worked around by stages.py (TracedStages.build, shapes given to the "
    "stages)",
)
def test_torch_stages_infer_their_shapes_without_running_on_uninitialised_inputs(one_rank):
    schedule = ScheduleInterleaved1F1B(_stages(Ids(), MaskReader()), 2, loss_fn=lambda o, t: o.sum())
    schedule.step(torch.randn(4, 4), target=torch.zeros(4))


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="https://github.com/pytorch/pytorch/issues/159942 (dynamic shapes in pipeline parallelism): a "
    "schedule keeps the shapes of its first step, and a later batch of another size fails (across ranks: a "
    "receive into a buffer of the old size, which takes the peer down); worked around by runner.py "
    "(PipelineRunner, one schedule per input shape)",
)
def test_torch_schedules_take_a_batch_of_another_shape_after_their_first(one_rank):
    # On one rank nothing is received; torch's own runtime validation (TORCH_DISTRIBUTED_DEBUG=DETAIL,
    # read when a stage is made) shows the same fixed shapes.
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        (stage,) = _stages(nn.Linear(4, 4))
    finally:
        dist.set_debug_level(level)
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda o, t: o.sum(), scale_grads=False)
    schedule.step(torch.randn(4, 4), target=torch.zeros(4))
    schedule.step(torch.randn(6, 4), target=torch.zeros(6))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'ScheduleZBVZeroBubble eval steal_bwd_input stage doesn't have "
    "backward' on 2026-12-03): a forward-only step fails where two adjacent stages share a rank (the V "
    "schedules always; interleaving on one rank) with 'can't steal_bwd_input if this stage doesn't have "
    "backward'; worked around by _v_forward.py (VForwardOnly), runner.py (PipelineRunner._schedule) and "
    "source.py (TracedSource refuses interleaving on one rank)",
)
def test_torch_runs_a_forward_only_step_of_adjacent_stages_on_one_rank(one_rank):
    torch.manual_seed(0)
    blocks, x = [nn.Linear(4, 4), nn.Linear(4, 4)], torch.randn(4, 4)
    out = ScheduleZBVZeroBubble(_stages(*blocks), 2).step(x)
    torch.testing.assert_close(out, blocks[1](blocks[0](x)))


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="https://github.com/pytorch/pytorch/issues/161904: torch refuses compiled stages under the "
    "schedules that split each backward (ZBV, DualPipeV, interleaved zero bubble); worked around by "
    "compile.py (check_compile), which also refuses blocks compiled in place: the weight pass reruns their "
    "fused backward (wrong gradients measured): re-measure that before deleting it",
)
def test_torch_split_backward_schedules_take_compiled_stages(one_rank):
    stages = _stages(torch.compile(nn.Linear(4, 4)), torch.compile(nn.Linear(4, 4)))  # compiles lazily
    ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda o, t: o.sum(), scale_grads=False)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="https://github.com/pytorch/pytorch/pull/196641 (an open pull request; no issue found): a "
    "schedule's step ends FSDP's backward with set_requires_gradient_sync(True), reduce-scattering every "
    "step whatever the module was told; worked around by fsdp/sharding.py (DeferredReduceStage) "
    "and fsdp/_internals.py (finish_backward)",
)
def test_torch_schedules_keep_an_fsdp_module_s_gradient_sync_off(one_rank):
    from torch.distributed.fsdp import fully_shard

    module = fully_shard(nn.Linear(4, 4), mesh=_mesh())
    module.set_requires_gradient_sync(False)  # accumulate: reduce at the window's last step only
    (stage,) = _stages(module)
    ScheduleGPipe(stage, 2, loss_fn=lambda o, t: o.sum(), scale_grads=False).step(
        torch.randn(4, 4), target=torch.zeros(4)
    )
    assert all(p.grad is None for p in module.parameters()), "gradients were reduced into .grad"


# --- DTensor, compile, autograd ----------------------------------------------------------------------


_REGISTRY = """def registered():  # DTensor's rules by op (private, torch 2.13)
            prop = DTensor._op_dispatcher.sharding_propagator
            return {**prop.op_to_rules, **prop.op_strategy_funcs, **prop.op_single_dim_strategy_funcs}"""


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'DTensor sharding strategy missing "
    "_scaled_dot_product_flash_attention_for_cpu' on 2026-12-03): DTensor has no sharding rule for torch "
    "2.13's CPU flash attention (forward, backward) nor for _assert_tensor_metadata; worked around by "
    "traced.py (register_missing_shardings)",
)
def test_dtensor_has_sharding_rules_for_cpu_flash_attention_and_tensor_metadata_checks():
    # A process of its own: the registration this package makes is global to the process. (On a mesh of
    # one rank DTensor runs the op locally without a rule: the registry is what decides on more ranks.)
    code = textwrap.dedent(
        f"""
        import torch
        from torch.distributed.tensor import DTensor
        {_REGISTRY}
        aten = torch.ops.aten
        ops = (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
               aten._assert_tensor_metadata.default)
        missing = [str(op) for op in ops if op not in registered()]
        assert not missing, "no sharding rule for " + ", ".join(missing)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_dtensor_canary_reads_the_registry_where_torch_keeps_it():
    """If torch moves its rule registry, the canary above would stay failing for that reason alone."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    registered = {**prop.op_to_rules, **prop.op_strategy_funcs, **prop.op_single_dim_strategy_funcs}
    assert torch.ops.aten.mm.default in registered


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="no upstream issue found (searched 'implicit_replication nested context manager exit disables "
    "outer' on 2026-12-03): DTensor's implicit_replication does not nest (an inner one's exit turns it off "
    "for the outer); worked around by traced.py (TensorParallelStep, one context for the step)",
)
def test_dtensor_implicit_replication_nests(one_rank):
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    x = distribute_tensor(torch.ones(2), _mesh(), [Replicate()])
    with implicit_replication():
        with implicit_replication():
            pass
        x + torch.ones(2)  # a plain tensor met as a replicated one


@pytest.mark.xfail(
    strict=True,
    raises=NotImplementedError,
    reason="no upstream issue found (searched 'ZeroRedundancyOptimizer DTensor parameters broadcast sharding "
    "strategy' on 2026-12-03): ZeroRedundancyOptimizer broadcasts plain tensors and cannot step DTensor "
    "parameters; worked around by zero.py (Zero.check refuses zero1 with tensor parallelism)",
)
def test_zero_redundancy_optimizer_steps_dtensor_parameters(one_rank):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    optimizer = ZeroRedundancyOptimizer([weight], torch.optim.SGD, lr=0.1)
    weight.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    optimizer.step()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'dynamo recompile input is a view guard on base tensor size "
    "duck sizing' on 2026-12-03; pytorch issue 129798, closed, is a different view case): dynamo guards on "
    "a micro-batch's base (the whole batch) too, so a batch size equal to the sequence length compiles "
    "again at the short last batch; worked around by compile.py (OwnInputs)",
)
def test_dynamo_compiles_once_for_micro_batches_sliced_from_batches_of_several_sizes():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter, embedding = CompileCounter(), nn.Embedding(16, 4)
    step = torch.compile(lambda ids: embedding(ids).sum(), backend=counter, dynamic=True)
    try:
        for batch_size in (8, 8, 6, 5):  # 8 = the sequence length; 5: the epoch's short last batch
            for micro_batch in torch.randint(0, 16, (batch_size, 8)).chunk(2):  # views of the batch
                step(micro_batch)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="https://github.com/pytorch/pytorch/issues/122109 (closed for tensor creation; autograd on such "
    "tensors still aborts in 2.13): autograd cannot record on a fake tensor of a device this build lacks "
    "(fake CUDA on a CPU-only build aborts the process with a c10::Error); worked around by fake_device.py "
    "(tracks_gradients)",
)
def test_autograd_records_on_fake_tensors_of_a_device_this_build_lacks():
    if torch.cuda.is_available():
        pytest.skip("the fault is a build's without CUDA: this build has it")  # a skip is no pass
    # A process of its own: the c10::Error is raised from C++ with nothing to catch it (abort).
    code = textwrap.dedent(
        """
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            weight = torch.empty(4, 4, device="cuda:0").requires_grad_(True)
            (weight * 2).sum()
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


# --- Lightning ---------------------------------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'Lightning SIGTERM received_sigterm broadcast in signal "
    "handler hangs' on 2026-12-03): Lightning 2.6.6's SIGTERM handler runs a broadcast inside the signal "
    "handler, which pairs with whatever collective another rank is in; worked around by stop.py "
    "(_StopNotifier, keep_lightning_sigterm_handling)",
)
def test_lightning_sigterm_handler_runs_no_collective(one_rank, monkeypatch):
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    collectives = []
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: collectives.append(args))
    trainer = SimpleNamespace(
        local_rank=0, world_size=2, strategy=SimpleNamespace(launcher=None, root_device=CPU)
    )
    _SignalConnector(trainer)._sigterm_notifier_fn(signal.SIGTERM, None)
    assert not collectives, f"the handler ran {len(collectives)} broadcast(s)"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'Lightning forkserver start_method global state snapshot "
    "shared memory tensors only spawn' on 2026-12-03): Lightning 2.6.6's launcher restores the main "
    "process's global state and unshares CPU tensors for spawn workers only; a forkserver worker needs "
    "both; worked around by launcher.py (forkserver_parent_state, CleanExitMultiProcessingLauncher)",
)
def test_lightning_gives_a_forkserver_worker_what_it_gives_a_spawn_worker(monkeypatch):
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies.launchers import multiprocessing as launchers

    def start_here(fn, args, nprocs, start_method, join):  # the worker, in this process
        torch.manual_seed(123)  # the forkserver's own random state, not the main process's
        fn(0, *args)
        return SimpleNamespace(processes=[], join=lambda: True)

    monkeypatch.setattr(launchers.mp, "start_processes", start_here)
    environment = SimpleNamespace(main_port=29500)
    strategy = SimpleNamespace(cluster_environment=environment, num_processes=1, accelerator=CPUAccelerator())
    launcher = launchers._MultiProcessingLauncher(strategy, start_method="forkserver")
    weights = nn.Linear(2, 2)
    weights.share_memory()  # as torch.multiprocessing hands a worker its CPU tensors
    with torch.random.fork_rng():
        torch.manual_seed(7)
        with torch.random.fork_rng():
            expected = torch.rand(1)
        shared, drawn = launcher.launch(lambda m: (m.weight.is_shared(), torch.rand(1)), weights)
    assert not shared, "the worker trains the main process's tensors, shared with every other worker"
    assert torch.equal(drawn, expected), "the worker did not get the main process's random state"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="https://github.com/Lightning-AI/pytorch-lightning/pull/8080 (closed: 'we still don't destroy the "
    "process group after the Trainer ends'): Lightning 2.6.6's spawn workers leave their process group to an "
    "atexit hook they never run; worked around by launcher.py (CleanExitMultiProcessingLauncher)",
)
def test_lightning_spawn_worker_destroys_its_process_group():
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    # Not the one_rank fixture: its teardown destroys the group, which fails once Lightning does it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    strategy = SimpleNamespace(accelerator=CPUAccelerator(), num_processes=1)
    launcher = _MultiProcessingLauncher(strategy, start_method="spawn")
    launcher._wrapping_function(0, None, lambda: None, (), {}, SimpleNamespace(put=lambda _: None))
    assert not dist.is_initialized(), "the worker returned with its process group alive"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="no upstream issue found (searched 'Lightning child process observer kills main process SIGKILL "
    "KeyboardInterrupt' on 2026-12-04): on Lightning 2.6.6's KeyboardInterrupt path the script launcher's "
    "main process kills its ranks (launcher.kill), then exits with status 1; the launcher's child-process "
    "observer, polling every 5 s, sees a rank killed and SIGKILLs the main process too (status -9) if its "
    "poll falls before that exit; worked around by script_launcher.py "
    "(StoppingScriptLauncher.launch, _StopAwareObserver)",
)
def test_lightning_script_launcher_lets_its_main_process_exit_after_killing_its_ranks():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    main, rank = (subprocess.Popen(["sleep", "60"]) for _ in range(2))  # the main process, its rank 1
    try:
        launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
        launcher.procs = [rank]
        launcher.kill(signal.SIGKILL)  # what Lightning's KeyboardInterrupt path does, before sys.exit(1)
        rank.wait(10)
        _ChildProcessObserver(main_pid=main.pid, child_processes=launcher.procs)._run()  # its next poll
        with contextlib.suppress(subprocess.TimeoutExpired):
            main.wait(0.5)
        assert main.returncode is None, f"the observer ended the main process ({main.returncode})"
    finally:
        for proc in (main, rank):
            proc.kill()
            proc.wait()


# --- the markers in the package and the canaries here --------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_parallel"
_LINK = r"https://github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/\d+"
_MARKER = re.compile(
    rf"(torch|Lightning|torchmetrics) workaround: ({_LINK}|no upstream issue found)\s+canary: (\w+)"
)
_NAMED_CODE = re.compile(r"(\w+\.py) \(([A-Za-z_][\w.]*)")


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """Runs of consecutive comment lines, each as (first line, text without the ``#``s)."""
    blocks: list[tuple[int, str]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line, text = tok.start[0], tok.string.lstrip("#").strip()
        if line == last + 1:
            blocks[-1] = (blocks[-1][0], f"{blocks[-1][1]} {text}")
        else:
            blocks.append((line, text))
        last = line
    return blocks


def _markers() -> list[tuple[Path, int, str, str]]:
    """Every workaround marker in the package: (file, line, link or 'no upstream issue found', canary)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if "workaround:" not in source:
            continue
        for line, text in _comment_blocks(source):
            matches = list(_MARKER.finditer(text))
            assert len(matches) == text.count("workaround:"), (
                f"{path}:{line}: a workaround marker not in the form of this module's docstring"
            )
            found += [(path, line, m.group(2), m.group(3)) for m in matches]
    return found


def _canaries() -> dict[str, dict]:
    """The strict-xfail tests of this module: name -> the xfail's keywords."""
    canaries = {}
    for node in ast.parse(Path(__file__).read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.xfail":
                keywords = [k for k in decorator.keywords if k.arg in ("strict", "reason")]
                canaries[node.name] = {k.arg: ast.literal_eval(k.value) for k in keywords}
    return canaries


def test_every_workaround_marker_has_its_canary_and_every_canary_its_marker():
    markers, canaries = _markers(), _canaries()
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    for path, line, link, name in markers:
        where = f"{path.relative_to(PACKAGE.parent)}:{line}"
        assert name in canaries, f"{where} names canary {name}, which tests/{Path(__file__).name} lacks"
        assert link in canaries[name]["reason"], f"{where}: {link} is not in {name}'s reason"
        assert f"{path.name} (" in canaries[name]["reason"], (
            f"{where}: {name}'s reason does not name {path.name}"
        )
    for name, xfail in canaries.items():
        assert xfail.get("strict") is True, f"{name} is not a strict xfail"
        reason = xfail.get("reason", "")
        assert re.search(_LINK, reason) or re.search(
            r"no upstream issue found \(searched .+ on \d{4}-\d\d-\d\d", reason
        ), f"{name}: the reason gives neither an upstream link nor what was searched, and when"
        assert name in {m[3] for m in markers}, f"no workaround marker in lightning_parallel/ names {name}"
        named = _NAMED_CODE.findall(reason)
        assert named, f"{name}: the reason names no file (function) that works around the fault"
        for filename, identifier in named:
            texts = [text for p, text in sources.items() if p.name == filename]
            assert texts, f"{name}: {filename}, named in its reason, is no file of lightning_parallel/"
            holds = [t for t in texts if all(part in t for part in identifier.split("."))]
            assert holds, f"{name}: no {filename} in lightning_parallel/ holds {identifier}"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="https://github.com/pytorch/pytorch/issues/150915 (fix: pytorch PR 185722): Module.compile on one "
    "of torch's own modules (nn.Sequential, nn.Linear) compiles its _call_impl, a frame in torch's files "
    "that dynamo skips, so nothing is ever compiled; worked around by compile.py (compile_torch_module)",
)
def test_torch_compiles_a_sequential_compiled_in_place():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    block.compile(backend="eager")
    block(torch.randn(2, 4))
    assert counters["frames"]["ok"] >= 1, dict(counters["frames"])
