"""The suite's guard against order dependence (global_state.py, run around every test by conftest.py)."""

import torch
import torch.distributed as dist
from global_state import changes, snapshot
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase


def test_an_unrestored_patch_of_torch_distributed_is_named():
    before = snapshot()
    original = dist.barrier
    dist.barrier = lambda *args, **kwargs: None
    try:
        [change] = changes(before, snapshot())
    finally:
        dist.barrier = original
    assert change.startswith("torch.distributed.barrier: <function ")
    assert change.endswith(f"(was {original!r})")
    assert changes(before, snapshot()) == []  # restored: nothing left


def test_the_pipeline_schedule_the_stage_class_and_torch_flags_are_watched():
    before = snapshot()
    originals = schedules._batch_p2p, _PipelineStageBase.forward_one_chunk
    schedules._batch_p2p = _PipelineStageBase.forward_one_chunk = print
    torch.set_grad_enabled(False)
    try:
        found = changes(before, snapshot())
    finally:
        schedules._batch_p2p, _PipelineStageBase.forward_one_chunk = originals
        torch.set_grad_enabled(True)
    assert [line.split(": ")[0] for line in found] == [
        "torch.distributed.pipelining.schedules._batch_p2p",
        "torch.distributed.pipelining.stage:_PipelineStageBase.forward_one_chunk",
        "torch flags.grad enabled",
    ]


def test_a_name_an_import_adds_is_not_a_change():
    before = snapshot()
    after = {**before, "torch.distributed": {**before["torch.distributed"], "new_function": print}}
    assert changes(before, after) == []
