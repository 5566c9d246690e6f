"""The private FSDP2 state that a pipeline must drive by hand, reached from this one module.

torch's ``PipelineStage`` runs backward with ``torch.autograd.backward`` per micro-batch and, at the end
of every ``schedule.step()``, finishes FSDP's backward itself (``PipelineStage.perform_reduce_grad``,
torch 2.13): it calls ``post_backward()`` on every FSDP parameter group, then the root's final
callback. :func:`finish_backward` does the same with gradient sync on or off, so the strategy can
reduce-scatter once per optimizer step instead of once per ``step()``. ``tests/test_pipeline_fsdp.py``
(a spy on finish_backward, and the runs equal to one device) fails loudly if these names move.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, fully_shard


# torch workaround: https://github.com/pytorch/pytorch/pull/196641
#   canary: test_torch_schedules_keep_an_fsdp_module_s_gradient_sync_off
def finish_backward(root: FSDPModule, reduce: bool) -> None:
    """End FSDP's backward on ``root`` and every FSDP module under it; reduce gradients if ``reduce``.

    Without ``reduce`` the parameters are resharded and the unsharded gradients stay accumulated
    inside FSDP (``set_requires_gradient_sync(False)``'s accumulation); with it they are
    reduce-scattered (and all-reduced over the replicate dimension of an HSDP mesh) into the sharded
    parameters' ``.grad``, added to what is there.
    """
    root.set_is_last_backward(True)
    root.set_reshard_after_backward(True)
    root.set_requires_gradient_sync(reduce)
    state = fully_shard.state(root)  # type: ignore[attr-defined]
    for module_state in state._state_ctx.all_states:
        for param_group in module_state._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()
