"""techniques/parallelize.py: each stage module after the split, in torchtitan's order (one process, no mesh).

Its FSDP2 and tensor-parallel steps need a process group: tests/test_pipeline_fsdp.py and
tests/test_pipeline_tensor.py run them. Here: the user's function, the roots returned, and the errors.
"""

import pytest
from torch import nn

from lightning_parallel.plan.choices import DATA_PARALLEL
from lightning_parallel.techniques.parallelize import parallelize_stages


def _stages():
    return [nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(nn.Linear(2, 2))]


@pytest.mark.parametrize("data_parallel", ["replicate", "zero1"])
def test_replicas_and_zero1_leave_the_stages_as_they_are_and_run_the_users_function_on_each(data_parallel):
    stages, seen = _stages(), []

    def parallelize_fn(module, mesh):
        seen.append((module, mesh))
        module.touched = True
        return module if len(seen) == 1 else None  # either is allowed

    roots = parallelize_stages(stages, None, None, data_parallel, parallelize_fn)
    assert roots == [] and seen == [(stages[0], None), (stages[1], None)]
    assert all(s.touched for s in stages) and data_parallel in DATA_PARALLEL


def test_a_function_that_returns_another_module_is_refused():
    with pytest.raises(TypeError, match=r"parallelize_fn returned a new Linear: it must change the stage"):
        parallelize_stages(_stages(), None, None, parallelize_fn=lambda module, mesh: nn.Linear(1, 1))


def test_fsdp_and_tensor_parallelism_without_a_mesh_are_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r'data_parallel="fsdp" needs a process group .* data_parallel="replicate"'
    ):
        parallelize_stages(_stages(), None, None, "fsdp")
    with pytest.raises(ValueError, match=r"tensor parallelism needs a process group"):
        parallelize_stages(_stages(), None, None, tensor_plan=object())
