"""Canaries: each torch 2.13 fault this package works around, shown on a tiny graph of its own.

Every test here asserts what torch *should* do and is ``xfail(strict=True)``: it fails today, so the
workaround is needed. The day torch fixes the fault the test passes, strict xfail turns that into a
failure, and the workaround (named in the reason, with its upstream issue) can be deleted on evidence.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline
from torch.distributed.pipelining._IR import _modify_graph_op_device

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch.export, inside torch


def _one_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


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
    reason="pytorch#184361: pipeline() outlines a no-grad region's output twice; worked around by "
    "lightning_parallel/traced/graph_regions.py (inline_wrapped_regions)",
)
def test_torch_pipeline_splits_a_model_whose_no_grad_region_feeds_a_later_stage():
    torch.manual_seed(0)
    model, x = RotaryModel(), torch.randn(2, 3, 4)
    pipe = pipeline(model, (x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    out = pipe.split_gm(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x))


@pytest.mark.xfail(
    strict=True,
    reason="torch's _modify_graph_op_device (Pipe.build_stage) rewrites device= keywords only, not a device "
    "given positionally (x.to(h.device)); worked around by lightning_parallel/traced/trace.py "
    "(device_args_as_keywords)",
)
def test_torch_moves_a_positional_device_of_a_stage_graph():
    graph = fx.Graph()
    x = graph.placeholder("x")
    moved = graph.call_function(torch.ops.aten.to.device, (x, torch.device("meta"), torch.float32))
    graph.output(moved)
    gm = fx.GraphModule(nn.Module(), graph)
    _modify_graph_op_device(gm, torch.device("cpu"))
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
    reason="torch's traced stages cannot receive a root input of forward after stage 0 ('expected non-root "
    "_RecvInfo but got root arg'); worked around by lightning_parallel/traced/relay.py (relay_skips)",
)
def test_torch_traced_stages_give_a_later_stage_an_input_of_forward():
    _one_process_group()
    model, x = RootReader(), torch.randn(2, 4)
    pipe = pipeline(model, (x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    stage = pipe.build_stage(1, torch.device("cpu"), dist.group.WORLD)
    stage._prepare_forward_infra(1, None, has_backward=True)  # private, torch 2.13: the stage's set-up
    stage._retrieve_recv_activations(0)  # what the stage's first forward runs


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.13 infers a manual PipelineStage's shapes at its first step by calling loss_fn once "
    "more, on a dummy output; worked around by lightning_parallel/pipeline/runner.py "
    "(_metadata_call_pending) "
    "and by giving the stages their shapes (stage_shapes.py)",
)
def test_torch_schedules_call_loss_fn_once_per_micro_batch_when_they_infer_shapes():
    _one_process_group()
    calls = []

    def loss_fn(output, target):
        calls.append(int(target.numel()))
        return output.sum()

    stage = PipelineStage(nn.Linear(4, 4), 0, 1, torch.device("cpu"), group=dist.group.WORLD)
    schedule = ScheduleGPipe(stage, 2, loss_fn=loss_fn, scale_grads=False)
    schedule.step(torch.randn(4, 4), target=torch.zeros(4))
    assert len(calls) == 2, calls


@pytest.mark.xfail(
    strict=True,
    reason="DTensor has no sharding rule for torch 2.13's CPU flash attention "
    "(aten._scaled_dot_product_flash_attention_for_cpu); worked around by lightning_parallel/traced/"
    "tensor_parallel.py (register_missing_shardings)",
)
def test_dtensor_has_a_sharding_rule_for_the_cpu_flash_attention_kernel():
    # A process of its own: the registration this package makes is global to the process. (On a mesh of
    # one rank DTensor runs the op locally without a rule: the registry is what decides on more ranks.)
    code = textwrap.dedent(
        f"""
        import torch
        from torch.distributed.tensor import DTensor
        {_REGISTRY}
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        assert op in registered(), "no sharding rule"
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


_REGISTRY = """def registered():  # DTensor's rules by op (private, torch 2.13)
            prop = DTensor._op_dispatcher.sharding_propagator
            return {**prop.op_strategy_funcs, **prop.op_single_dim_strategy_funcs}"""


def test_the_dtensor_canary_reads_the_registry_where_torch_keeps_it():
    """If torch moves its rule registry, the canary above would stay failing for that reason alone."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    registered = {**prop.op_strategy_funcs, **prop.op_single_dim_strategy_funcs}
    assert torch.ops.aten.mm.default in registered
