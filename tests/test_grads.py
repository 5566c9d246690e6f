"""grads/reduce.py: gradients held for Lightning's backward, averaged over replicas, clipped globally.

Also covers grads/sync.py (one optimizer step's synchronisation) on one process, and on two gloo ranks.
"""

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo

from lightning_parallel.grads.held import HeldGradients
from lightning_parallel.grads.reduce import all_reduce_gradients, clip_grad_norm_across


def _params_with_grads(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(3, 4), (4,), (2, 2)]]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_without_a_group_it_is_torch_clip_grad_norm(norm_type, max_norm):
    ours, theirs = _params_with_grads(), _params_with_grads()
    ours.append(torch.nn.Parameter(torch.ones(2)))  # no gradient: left out, as torch does
    total = clip_grad_norm_across(ours, max_norm, None, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    assert ours[-1].grad is None
    clipped = max_norm < float(expected)
    assert clipped == (not torch.equal(ours[0].grad, _params_with_grads()[0].grad))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_a_replica_not_counted_is_left_out_of_the_norm_but_scaled_like_the_rest(norm_type):
    params = _params_with_grads(scale=10.0)
    replica = torch.nn.Parameter(torch.zeros(5))
    replica.grad = torch.full((5,), 100.0)  # larger than all the rest: it would decide the inf norm
    counted = _params_with_grads(scale=10.0)
    expected = torch.nn.utils.clip_grad_norm_(counted, 1.0, norm_type)
    total = clip_grad_norm_across([*params, replica], 1.0, None, norm_type, not_counted=[replica])
    torch.testing.assert_close(total, expected)
    coef = 1.0 / (float(expected) + 1e-6)
    torch.testing.assert_close(replica.grad, torch.full((5,), 100.0 * coef))
    for a, b in zip(params, counted):
        torch.testing.assert_close(a.grad, b.grad)


def test_nothing_to_clip_gives_a_zero_norm():
    p = torch.nn.Parameter(torch.ones(2))
    assert float(clip_grad_norm_across([p], 1.0, None)) == 0.0 and p.grad is None
    p.grad = torch.full((2,), 3.0)
    assert float(clip_grad_norm_across([p], 1.0, None, not_counted=[p])) == 0.0
    torch.testing.assert_close(p.grad, torch.full((2,), 3.0))  # coefficient 1: a zero norm clips nothing


def test_held_gradients_keep_this_batch_apart_until_lightning_backward():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.full((2,), 10.0)  # accumulated from earlier batches of the window
    held = HeldGradients()
    with held.collecting([a, b]):
        assert a.grad is None and b.grad is None  # the schedule's backward sees this batch only
        (3 * a).sum().backward()
        (5 * b).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((2,), 10.0))  # restored for Lightning's zero_grad
    assert b.grad is None

    a.grad = None  # Lightning zeroed the gradients between training_step and backward
    held.add_to_grads()
    torch.testing.assert_close(a.grad, torch.full((2,), 3.0))
    torch.testing.assert_close(b.grad, torch.full((2,), 5.0))
    held.add_to_grads()  # released once: a second backward adds nothing
    torch.testing.assert_close(a.grad, torch.full((2,), 3.0))

    with held.collecting([a, b]):
        (2 * a).sum().backward()  # b is not reached in this batch
    held.add_to_grads()
    torch.testing.assert_close(a.grad, torch.full((2,), 5.0))  # added to the accumulated gradient
    torch.testing.assert_close(b.grad, torch.full((2,), 5.0))


def _worker(rank: int, world: int, out_dir: str) -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    params.append(torch.nn.Parameter(torch.zeros(1)))
    params[0].grad = torch.full((3,), float(rank + 1))
    params[1].grad = torch.full((2,), 10.0 * (rank + 1), dtype=torch.float64)
    all_reduce_gradients(params, None)  # params[2] has no gradient on any rank: skipped
    averaged = [p.grad.clone() for p in params[:2]]

    # Each rank holds a slice of the model's gradients; the norm is that of all of them together.
    slices = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0, 12.0])]
    mine = torch.nn.Parameter(torch.zeros_like(slices[rank]))
    mine.grad = slices[rank].clone()
    total = clip_grad_norm_across([mine], 6.5, dist.group.WORLD)
    mine_inf = torch.nn.Parameter(torch.zeros_like(slices[rank]))
    mine_inf.grad = slices[rank].clone()
    total_inf = clip_grad_norm_across([mine_inf], 6.0, dist.group.WORLD, float("inf"))
    torch.save(
        {
            "averaged": averaged,
            "untouched": params[2].grad,
            "total": total,
            "clipped": mine.grad,
            "total_inf": total_inf,
            "clipped_inf": mine_inf.grad,
        },
        f"{out_dir}/rank{rank}.pt",
    )


def test_earlier_gradients_dropped_before_the_schedule_or_added_into():
    a = torch.nn.Parameter(torch.ones(2))
    a.grad = torch.full((2,), 10.0)  # the previous step's: Lightning zeroes them after this training_step
    earlier = a.grad
    held = HeldGradients()
    with held.collecting([a], earlier="drop"):
        assert a.grad is None  # released: one gradient's worth of memory during the schedule
        (3 * a).sum().backward()
    assert a.grad is None and torch.equal(earlier, torch.full((2,), 10.0))  # not reused for the new ones
    held.add_to_grads()
    torch.testing.assert_close(a.grad, torch.full((2,), 3.0))

    with held.collecting([a], earlier="add"):  # inside a window: Lightning does not zero in between
        (2 * a).sum().backward()
        torch.testing.assert_close(a.grad, torch.full((2,), 5.0))
    held.add_to_grads()  # nothing was held: the schedule added in place
    torch.testing.assert_close(a.grad, torch.full((2,), 5.0))
    with pytest.raises(ValueError, match="earlier must be one of"), held.collecting([a], earlier="discard"):
        pass


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_gloo_ranks_average_gradients_and_clip_by_the_norm_over_both(tmp_path):
    results = spawn_gloo(_worker, 2, tmp_path)
    slices = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0, 12.0])]
    whole = torch.cat(slices)
    for r in results:
        torch.testing.assert_close(r["averaged"][0], torch.full((3,), 1.5))
        torch.testing.assert_close(r["averaged"][1], torch.full((2,), 15.0, dtype=torch.float64))
        assert r["untouched"] is None
        torch.testing.assert_close(r["total"], torch.linalg.vector_norm(whole))  # 13, not 3 or 12.6
        torch.testing.assert_close(r["total_inf"], torch.tensor(12.0))
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["clipped"], slices[rank] * (6.5 / (13.0 + 1e-6)))
        torch.testing.assert_close(r["clipped_inf"], slices[rank] * (6.0 / (12.0 + 1e-6)))


def test_the_step_s_sync_scales_to_the_token_mean_of_its_window():
    from lightning_parallel.grads.item_weights import ItemWindow
    from lightning_parallel.grads.sync import GradientSync
    from lightning_parallel.grads.tied import SharedReplicas
    from lightning_parallel.layout.mesh import build_mesh
    from lightning_parallel.layout.ranks import RankLayout
    from lightning_parallel.techniques.replicas import Average

    module = torch.nn.Linear(3, 2)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    shared = SharedReplicas([], build_mesh("cpu", RankLayout(1, 1)), dict(module.named_parameters()))
    window = ItemWindow()
    window.add_batch(6.0, None)  # the window's first batch: 6 items, the losses' reference
    window.add_batch(2.0, None)  # a second batch of 2: the step's mean is over 8
    GradientSync(module, shared, [Average(module, None)], 1, window)()
    assert torch.equal(module.weight.grad, torch.full((2, 3), 6 / 8))
    GradientSync(module, shared, [Average(module, None)], 1)()  # sample-weighted: nothing to scale
    assert torch.equal(module.weight.grad, torch.full((2, 3), 6 / 8))
