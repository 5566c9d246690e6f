"""grads/loss_scale.py: found_inf agreed over the ranks, so every rank skips an fp16 step or none does.

The multi-rank check runs inside test_pipeline_precision.py's spawned job (one spawn for both files).
"""

import torch

from lightning_parallel.grads.loss_scale import agree_found_inf, agree_on_overflow


def _scaled_step(scaler, grad_value: float, weight: torch.nn.Parameter | None = None) -> torch.nn.Parameter:
    """One GradScaler step of SGD on a 2-element weight whose gradient is ``grad_value`` (maybe inf)."""
    weight = weight if weight is not None else torch.nn.Parameter(torch.ones(2))
    weight.grad = None
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler.scale((weight * grad_value).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return weight


def test_the_private_found_inf_state_is_where_torch_keeps_it():
    """Fails loudly when torch moves GradScaler._per_optimizer_states[...]["found_inf_per_device"]."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler.scale((weight * float("inf")).sum()).backward()
    scaler.unscale_(optimizer)
    assert agree_found_inf(scaler, optimizer) is True  # one process: its own finding
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(2)) and scaler.get_scale() == 2.0


def test_a_rank_without_gradients_gets_a_found_inf_entry_and_can_step():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale exists (the strategy scales the broadcast loss on every rank)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    scaler.unscale_(optimizer)
    assert agree_found_inf(scaler, optimizer) is False
    scaler.step(optimizer)  # torch alone raises "No inf checks were recorded for this optimizer."
    scaler.update()


def test_installing_wraps_unscale_once_and_leaves_a_disabled_scaler_alone():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    agree_on_overflow(scaler)
    agree_on_overflow(scaler)  # a second fit: the wrapper is replaced, not nested
    assert scaler.unscale_.__wrapped__ == torch.amp.GradScaler.unscale_.__get__(scaler)
    assert _scaled_step(scaler, 1.0).detach().tolist() == [0.0, 0.0]
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    agree_on_overflow(disabled)
    assert "unscale_" not in vars(disabled)


def agreement_outcome(rank: int) -> dict:
    """Two GradScaler steps on this rank of a process group: only rank 1 overflows at the first.

    Run inside test_pipeline_precision.py's spawned job (one spawn for both files' multi-rank checks).
    """
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    agree_on_overflow(scaler)
    weight = _scaled_step(scaler, float("inf") if rank == 1 else 1.0)
    after_skip, scales = weight.detach().tolist(), [scaler.get_scale()]
    after_step = _scaled_step(scaler, 1.0, weight).detach().tolist()
    return {"after_skip": after_skip, "after_step": after_step, "scales": [*scales, scaler.get_scale()]}


def check_agreement(outcomes: list[dict]) -> None:
    for r in outcomes:
        assert r["after_skip"] == [1.0, 1.0]  # only rank 1's gradients overflowed: every rank skipped
        assert r["after_step"] == [0.0, 0.0]
        assert r["scales"] == [4.0, 8.0]  # backed off together, then grew together (growth_interval=1)
