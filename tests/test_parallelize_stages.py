"""The techniques' stage transforms (techniques/__init__.py's transform_stages, folding TECHNIQUES) on a
Sequential's stage modules, in torchtitan's order (one process, no mesh); techniques/user_function.py
and techniques/tensor_parallel/technique.py through it.

Its FSDP2 and tensor-parallel steps need a process group: tests/test_pipeline_fsdp.py and
tests/test_pipeline_tensor.py run them. Here: the user's function, the roots returned, and the errors.
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.layout.mesh import build_mesh
from lightning_parallel.layout.ranks import RankLayout
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.sources.sequential.stages import SequentialStages
from lightning_parallel.techniques import transform_stages
from lightning_parallel.techniques.job import Job

MESH = build_mesh("cpu", RankLayout(1, 1))  # one process: no device mesh


def parallelize(stages, plan, mesh, module, read=None):
    """The stage transforms of ``plan``'s techniques; (the FSDP2 roots, the log's lines)."""
    notes = transform_stages(Job(plan, mesh, torch.device("cpu"), stages, module, before_split=read or {}))
    return [m for m in stages.modules if isinstance(m, FSDPModule)], notes


def _stages():
    modules = [nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(nn.Linear(2, 2))]
    return SequentialStages(modules, [0, 1], 2, "cpu", None)


@pytest.mark.parametrize("data_parallel", ["replicate", "zero1"])
def test_replicas_and_zero1_leave_the_stages_as_they_are_and_run_the_users_function_on_each(data_parallel):
    stages, seen = _stages(), []

    def parallelize_fn(module, mesh):
        seen.append((module, mesh))
        module.touched = True
        return module if len(seen) == 1 else None  # either is allowed

    plan = ParallelPlan(data_parallel=data_parallel, parallelize_fn=parallelize_fn)
    roots, notes = parallelize(stages, plan, MESH, nn.Module())
    assert roots == [] and seen == [(stages.modules[0], None), (stages.modules[1], None)]
    assert all(s.touched for s in stages.modules) and notes == []


def test_compile_is_applied_to_the_stages_and_said_in_words():
    stages = _stages()
    _, notes = parallelize(stages, ParallelPlan(compile={"backend": "eager"}), MESH, nn.Module())
    assert notes == [
        "each stage compiles its layers in place (torch.compile, {'dynamic': True, 'backend': 'eager'})"
    ]


def test_a_function_that_returns_another_module_is_refused():
    plan = ParallelPlan(parallelize_fn=lambda module, mesh: nn.Linear(1, 1))
    with pytest.raises(TypeError, match=r"parallelize_fn returned a new Linear: it must change the stage"):
        parallelize(_stages(), plan, MESH, nn.Module())


def test_fsdp_and_tensor_parallelism_without_a_mesh_are_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r'data_parallel="fsdp" needs a process group .* data_parallel="replicate"'
    ):
        parallelize(_stages(), ParallelPlan(data_parallel="fsdp"), MESH, nn.Module())
    with pytest.raises(ValueError, match=r"tensor parallelism needs a process group"):
        parallelize(_stages(), ParallelPlan(), MESH, nn.Module(), read={"tensor_parallel": object()})
