"""ZeRO-1 mechanics (optim/sharded.py, techniques/zero.py) without Lightning: exact steps, whole state on
replica 0, reload; the settings every rebuilt optimizer takes (optim/settings.py)."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_parallel.optim.settings import accepted_settings
from lightning_parallel.optim.sharded import consolidate, is_sharded, local_state_bytes, shard_optimizer_state
from lightning_parallel.techniques.zero import shard_sizes

STEPS = 3


class _FixedMomentum(torch.optim.SGD):
    """A subclass whose constructor takes fewer settings than its ``defaults`` hold."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr, momentum=0.9)


def test_accepted_settings_keeps_what_the_constructor_takes():
    """A scheduler's ``initial_lr`` in a group, a subclass's fixed ``momentum``, ``params``: not passed on."""
    param = nn.Parameter(torch.zeros(2))
    optimizer = _FixedMomentum([param], lr=0.5)
    optimizer.param_groups[0]["initial_lr"] = 0.5
    assert accepted_settings(_FixedMomentum, optimizer.defaults) == {"lr": 0.5}
    assert accepted_settings(_FixedMomentum, optimizer.param_groups[0]) == {"lr": 0.5}
    adam = accepted_settings(torch.optim.AdamW, {"lr": 0.1, "fused": None, "foreach": None}, drop=("fused",))
    assert adam == {"lr": 0.1, "foreach": None}
    rebuilt = _FixedMomentum([param], **accepted_settings(_FixedMomentum, optimizer.defaults))
    assert rebuilt.defaults == optimizer.defaults


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def _build(model: nn.Module):
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2:].parameters(), "lr": 0.02}], lr=0.05
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # the same batch on every replica: no all-reduce
        optimizer.step()
        scheduler.step()


def _reference() -> tuple[dict, dict]:
    model = _model()
    optimizer, scheduler = _build(model)
    _train(model, optimizer, scheduler, STEPS)
    return model.state_dict(), optimizer.state_dict()


def _sharded_worker(rank: int, world: int, out_dir: str) -> None:
    model = _model()
    optimizer, scheduler = _build(model)
    plain_bytes_per_param = 2 * 4  # AdamW: exp_avg + exp_avg_sq, fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the retargeted scheduler must not warn
        sharded = shard_optimizer_state(optimizer, dist.group.WORLD, [scheduler])
        _train(model, sharded, scheduler, STEPS)
    consolidate(sharded)
    full = sharded.state_dict() if rank == 0 else None
    # Resume from the whole state at this shape: two more steps from it.
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2, sched2 = _build(model2)
    sharded2 = shard_optimizer_state(opt2, dist.group.WORLD, [sched2])
    box = [full]
    dist.broadcast_object_list(box, src=0)
    sharded2.load_state_dict(copy.deepcopy(box[0]))  # loading aliases the given tensors (CPU)
    sched2.load_state_dict(scheduler.state_dict())
    _train(model2, sharded2, sched2, 2, start=STEPS)
    torch.save(
        {
            "sharded": is_sharded(sharded),
            "lr": [g["lr"] for g in sharded.param_groups],
            "params": model.state_dict(),
            "full": full,
            "resumed": model2.state_dict(),
            "local_bytes": local_state_bytes(sharded),
            "full_bytes": plain_bytes_per_param * sum(p.numel() for p in model.parameters()),
            **_refusals(),
        },
        f"{out_dir}/rank{rank}.pt",
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sharded_adamw_steps_exactly_consolidates_the_whole_state_and_refuses_a_stepped_one(tmp_path):
    ref_params, ref_state = _reference()
    records = spawn_gloo(_sharded_worker, 2, tmp_path)
    for r in records:
        assert r["sharded"]
        assert r["lr"] == [0.05 * 0.5**STEPS, 0.02 * 0.5**STEPS]  # the scheduler drove the sharded one
        for k, v in ref_params.items():
            torch.testing.assert_close(r["params"][k], v, rtol=1e-6, atol=1e-7)
    # Each replica holds the state of its share only, as shard_sizes predicts (whole tensors, greedy).
    shares = shard_sizes([[192, 32], [1024, 32, 64, 2]], 2)
    assert shares == [290, 1056]
    steps = [4 * 4, 2 * 4]  # AdamW's fp32 "step" scalar per parameter tensor: 4 on rank 0, 2 on rank 1
    assert [r["local_bytes"] for r in records] == [8 * n + s for n, s in zip(shares, steps)]
    assert sum(shares) * 8 == records[0]["full_bytes"]
    full = records[0]["full"]
    assert sorted(full["state"]) == sorted(ref_state["state"])
    for i, s in ref_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(full["state"][i][key], s[key], rtol=1e-6, atol=1e-7)
    # A plain optimizer loads the consolidated state (same ids, groups and hyper-parameters).
    model = _model()
    plain, _ = _build(model)
    plain.load_state_dict(full)
    assert [g["lr"] for g in plain.param_groups] == [0.05 * 0.5**STEPS, 0.02 * 0.5**STEPS]

    # Resumed from the whole state on 2 sharded replicas == the reference continued for 2 steps.
    model = _model()
    optimizer, scheduler = _build(model)
    _train(model, optimizer, scheduler, STEPS + 2)
    for r in records:
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["resumed"][k], v, rtol=1e-6, atol=1e-7)
    # An optimizer that already stepped is refused (its state would be lost); a sharded one is kept.
    for r in records:
        assert "already holds state: shard it right after it is built" in r["error"]
        assert r["same"] and r["zero"]


def test_one_replica_or_no_process_group_leaves_the_optimizer_alone():
    model = _model()
    optimizer, _ = _build(model)
    assert shard_optimizer_state(optimizer, None) is optimizer
    assert not is_sharded(optimizer)
    consolidate(optimizer)  # a no-op, not an error


def _refusals() -> dict:
    """In the same job: a stepped optimizer refused, a sharded one returned as it is."""
    model = _model()
    optimizer, scheduler = _build(model)
    _train(model, optimizer, scheduler, 1)
    try:
        shard_optimizer_state(optimizer, dist.group.WORLD)
        error = ""
    except ValueError as err:
        error = str(err)
    sharded = shard_optimizer_state(_build(model)[0], dist.group.WORLD)
    again = shard_optimizer_state(sharded, dist.group.WORLD)
    return {"error": error, "same": again is sharded, "zero": isinstance(sharded, ZeroRedundancyOptimizer)}
