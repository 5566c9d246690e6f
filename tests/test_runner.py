"""runner.py: schedule names and which rank needs the input (pure logic; schedules run in the fits)."""

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.runner import PipelineRunner, is_multi_stage, schedule_class
from lightning_parallel.sources.sequential.stages import SequentialStages


def _runner(m: int = 4) -> PipelineRunner:
    return PipelineRunner(SequentialStages([nn.Identity()], [0], 1, torch.device("cpu"), None), 1, "gpipe", m)


def test_schedule_names_map_to_torch_schedules():
    assert schedule_class("1F1B").__name__ == "Schedule1F1B"
    assert is_multi_stage(schedule_class("interleaved_1f1b")) and not is_multi_stage(schedule_class("gpipe"))
    with pytest.raises(ValueError, match="unknown schedule 'zigzag': choose one of gpipe, 1f1b"):
        schedule_class("zigzag")


def test_only_the_first_stage_needs_the_input_on_the_sequential_path():
    runner = _runner()
    assert runner.has_first and runner.has_last and runner.needs_input(((4, 2),), 4, train=True)
    stages = SequentialStages([nn.Identity()], [1], 2, torch.device("cpu"), None)
    middle = PipelineRunner(stages, 3, "gpipe", 4)
    assert not middle.has_first and not middle.has_last and not middle.needs_input(((4, 2),), 4, train=True)
