"""A forward-only schedule for the V stage placement, from the private torch names it needs (torch 2.13).

torch's V schedules (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) always run their backward
actions, so an evaluation step (no loss function) fails in them; so does any multi-stage schedule's
where a stage and the next share a rank (every stage on one rank at ``pipeline_size=1``: "can't
steal_bwd_input if this stage doesn't have backward"). Evaluation under a V placement, and of several
stages per rank at ``pipeline_size=1`` (where the loop and the V placements are the same), runs this
schedule instead: on each rank, every micro-batch's forward through its first stage, then through
its second (rank r holds stages r and 2p-1-r; at p=1, through each stage in turn), lowered to sends
and receives by torch's own runtime (the lowering steps of
``_PipelineScheduleRuntime._prepare_schedule_with_comms``, whose own entry point insists on backward
actions). Private names used: ``_PipelineScheduleRuntime``, ``_Action``,
``_ComputationType``, ``_add_unshard_reshard``, ``_add_send_recv`` (``torch.distributed.pipelining.
schedules``) and the runtime's ``pipeline_order_with_comms``; ``tests/test_timeline.py`` fails loudly if
they move, and ``tests/test_pipeline_schedules.py`` validates under both V schedules and under the
interleaved ones at ``pipeline_size=1``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineScheduleRuntime,
)


# torch workaround: no upstream issue found
#   canary: test_torch_runs_a_forward_only_step_of_adjacent_stages_on_one_rank
class VForwardOnly(_PipelineScheduleRuntime):
    """Forward-only steps over stages placed in a V (or all on one rank: a V of one rank).

    Example::

        VForwardOnly([stage_r, stage_2p_1_r], num_microbatches).step(x)   # on rank r
    """

    def __init__(self, stages: list[Any], n_microbatches: int, **kwargs: Any) -> None:
        kwargs.pop("loss_fn", None)
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=None, **kwargs)
        mapping = generate_stage_to_rank_mapping(self.pp_group_size, self._num_stages, style="v")
        self.pipeline_order = {
            rank: [
                _Action(stage, _ComputationType.FORWARD, mb)
                for stage in sorted(s for s, r in mapping.items() if r == rank)
                for mb in range(n_microbatches)
            ]
            for rank in range(self.pp_group_size)
        }
        # What _prepare_schedule_with_comms does, less its check that every stage runs backwards.
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        lowered = {rank: _add_unshard_reshard(actions) for rank, actions in self.pipeline_order.items()}
        self.pipeline_order_with_comms = _add_send_recv(
            lowered, stage_to_rank=lambda s: mapping[s], num_stages=self._num_stages
        )
