"""pipeline/step_scope.py: the user's step marked while it runs, its collectives over other ranks refused.

One gloo rank in this process (no spawn). Under PipelineStrategy the refusal reaches every rank:
tests/test_pipeline_metrics.py checks that on 4 ranks.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.pipeline.step_scope import CollectiveOutsideStepError, StepScope

NO_RANK = frozenset()  # a step run by no rank: the world of one reaches beyond it


def test_a_replayed_step_refuses_a_collective_over_other_ranks_with_the_fix(one_rank):
    scope = StepScope(NO_RANK)
    assert not scope.active
    with scope.running("replay"):
        assert scope.active and scope.mode == "replay"
        with pytest.raises(
            CollectiveOutsideStepError, match=r"torch\.distributed\.all_reduce was called"
        ) as e:
            dist.all_reduce(torch.ones(1))
    assert "group=self.trainer.strategy.data_parallel_group" in str(e.value)
    assert isinstance(e.value, RuntimeError) and not scope.active
    dist.all_reduce(torch.ones(1))  # outside the step: goes through again


def test_a_captured_step_skips_the_collective_and_a_nested_mode_decides(one_rank):
    scope = StepScope(NO_RANK)
    with scope.running("capture"):
        assert dist.barrier() is None  # skipped: the last stage's replay raises the error
        with scope.running("replay"), pytest.raises(CollectiveOutsideStepError, match=r"\.barrier"):
            dist.barrier()
        assert scope.mode == "capture" and dist.barrier() is None


def test_the_steps_own_ranks_and_a_scope_without_ranks_let_collectives_through(one_rank):
    t = torch.ones(1)
    with StepScope(frozenset({0})).running("replay"):
        dist.all_reduce(t)  # every rank of the world runs this step
    with StepScope(None).running("replay"):
        dist.all_reduce(t)  # every rank runs every step: nothing is guarded
    assert t.item() == 1.0
