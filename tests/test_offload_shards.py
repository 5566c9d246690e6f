"""The optimizer of FSDP2 shards off the device, the shards on it (techniques/offload/shard_optimizer.py,
host_shards.py), and the disk tier under FSDP2 and ZeRO-1 (disk_optimizer.py).

Pure tests first (the DTensor view of a host tensor against ``DTensor.from_local``), then one spawned job of
2 gloo ranks that trains, each against the same run without offload: FSDP2 (``fully_shard`` on uneven
shards, a frozen first layer) with AdamW, gradient accumulation, clipping over all shards and an LR
schedule, its optimizer on the host (fp32 shards: parameters equal; bf16 shards: equal to the same fp32
master arithmetic done on the device); the state dict in the plain optimizer's layout, loaded both ways
and through the project's consolidated and distributed (DCP) checkpoint functions; then the disk tier
under FSDP2 and under ZeRO-1 the same way. On this CPU-only machine the "device" is the CPU: the copies
are real, separate tensors.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mp_harness import spawn_gloo
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_parallel.checkpoint import distributed as dcp_state
from lightning_parallel.distributed.dtensors import distribute_like, full_tensors
from lightning_parallel.optim import sharded as zero
from lightning_parallel.pipeline import state as stage_state
from lightning_parallel.techniques.offload.disk_optimizer import DiskTier, disk_step
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping
from lightning_parallel.techniques.offload.host_shards import host_local, placed_like
from lightning_parallel.techniques.offload.shard_optimizer import MASTER, host_step_shards

STEPS, ACCUMULATE, CLIP = 4, 2, 0.05


# ----------------------------------------------------------------------------------------- pure tests
def test_placed_like_is_from_local_without_moving_the_host_tensor(one_rank):
    """The one private access (a DTensor built from the parameter's spec): a canary for torch upgrades."""
    mesh = init_device_mesh("cpu", (1,))
    param = distribute_tensor(torch.randn(5, 3, dtype=torch.bfloat16), mesh, [Shard(0)])
    local = torch.randn(5, 3)
    view = placed_like(local, param)
    public = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
    )
    assert isinstance(view, DTensor) and view.to_local().data_ptr() == local.data_ptr()
    assert (view.shape, view.stride(), view.dtype, view.placements) == (
        public.shape,
        public.stride(),
        public.dtype,
        public.placements,
    )
    assert torch.equal(view.full_tensor(), local)
    assert placed_like(local, torch.zeros(5, 3)) is local
    # Back to the host shard: from a DTensor, a full tensor, a 0-dim step; cast where asked.
    assert torch.equal(host_local(view, param), local)
    assert host_local(local.double(), param, torch.float32).dtype == torch.float32
    step = torch.tensor(3.0)
    assert host_local(step, param, torch.bfloat16) is step


# ---------------------------------------------------------------------------------- the spawned job
def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # 13 and 21 rows over 2 ranks: uneven shards; 3 rows: one rank's shard of the last bias has 1 row.
    model = nn.Sequential(nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 21), nn.Tanh(), nn.Linear(21, 3))
    model[0].requires_grad_(False)  # frozen (a LoRA base): no host copy, no state
    return model.to(dtype)


def _sharded(dtype: torch.dtype = torch.float32) -> nn.Module:
    model = _model(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: nn.Module):
    # The frozen layer is in the first group: the plain optimizer skips it (no gradient), so must offload.
    groups = [
        {"params": [*model[0].parameters(), *model[2].parameters()]},
        {"params": model[4].parameters(), "lr": 0.02},
    ]
    optimizer = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return optimizer, scheduler


def _batches(step: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    for _ in range(ACCUMULATE):
        yield torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)


def _train(model, optimizer, scheduler, steps: int, start: int = 0, masters=None) -> list[float]:
    """Accumulation, clipping over every shard (torch's DTensor-aware norm), then the step."""
    dtype = next(model.parameters()).dtype
    norms = []
    for step in range(start, start + steps):
        for x, y in _batches(step, dtype):
            (nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if masters is not None:
            _master_step(model, optimizer, masters)
        else:
            optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return norms


def _master_step(model, optimizer, masters) -> None:
    """The reference of bf16 shards: a plain AdamW over fp32 DTensor masters on the device."""
    with torch.no_grad():
        for p, m in masters.items():
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None  # (the masters' optimizer's zero_grad does not reach the model's)
        optimizer.step()
        for p, m in masters.items():
            p.copy_(m.to(p.dtype))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in full_tensors(model.state_dict()).items()}


def _full_state(optimizer) -> dict:
    sd = optimizer.state_dict()
    return copy.deepcopy({"state": full_tensors(sd["state"]), "param_groups": sd["param_groups"]})


def _names(model: nn.Module) -> dict:
    return {p: n for n, p in model.named_parameters()}


def _host_tier(out: dict) -> None:
    """FSDP2, fp32 shards: the host-stepping optimizer against the plain one, the state dict both ways."""
    model, plain_model = _sharded(), _sharded()
    optimizer, scheduler = _optimizer(model)
    optimizer = host_step_shards(optimizer, pin_memory=False, schedulers=[scheduler])
    plain, plain_scheduler = _optimizer(plain_model)
    out["norms"] = (
        _train(model, optimizer, scheduler, STEPS),
        _train(plain_model, plain, plain_scheduler, STEPS),
    )
    out["params"] = (_full(model), _full(plain_model))
    out["lrs"] = ([g["lr"] for g in optimizer.param_groups], [g["lr"] for g in plain.param_groups])
    out["state"] = (_full_state(optimizer), _full_state(plain))
    out["host_state"] = all(
        v.to_local().device.type == "cpu" and v.to_local().data_ptr() != p.to_local().data_ptr()
        for p, s in optimizer.state.items()
        for v in s.values()
        if isinstance(v, DTensor)
    )
    out["types"] = (type(optimizer).__name__, is_host_stepping(optimizer))
    # The state dict loads both ways: host -> plain and plain -> host continue as the plain run does.
    resumed = {}
    for name, source, offload in (("into_plain", optimizer, False), ("into_host", plain, True)):
        m = _sharded()
        m.load_state_dict(model.state_dict())
        o, s = _optimizer(m)
        if offload:
            o = host_step_shards(o, False, [s])
        o.load_state_dict(copy.deepcopy(source.state_dict()))
        s.load_state_dict(scheduler.state_dict())
        _train(m, o, s, 2, start=STEPS)
        resumed[name] = _full(m)
    _train(plain_model, plain, plain_scheduler, 2, start=STEPS)
    out["resumed"] = (resumed, _full(plain_model))


def _offloaded(optimizer, scheduler, tier: str, tmp: Path):
    if tier == "host":
        return host_step_shards(optimizer, False, [scheduler])
    return disk_step(optimizer, DiskTier(str(tmp / "scratch"), DISK_BUFFER), schedulers=[scheduler])


def _checkpoint_paths(out: dict, tmp: Path, tier: str) -> None:
    """The project's checkpoint functions over the offloaded optimizer: the consolidated state (full
    tensors by name, resharded on load) and the distributed one (DCP, flat by name) load into a fresh one
    and continue as the run that saved them."""
    model = _sharded()
    optimizer, scheduler = _optimizer(model)
    optimizer = _offloaded(optimizer, scheduler, tier, tmp)
    _train(model, optimizer, scheduler, 2)
    names, order = _names(model), [n for n, _ in model.named_parameters()]
    # (deep-copied: a state dict holds the live step tensors, which a loaded optimizer would share)
    consolidated = copy.deepcopy(stage_state.named_optimizer_state(optimizer, names, full_tensors))
    flat = dcp_state.flat_optimizer_state(optimizer, names)
    dcp_dir = str(tmp / f"dcp_{tier}")
    dist.barrier()
    dcp_state.dcp.save({"optimizer_0": flat}, checkpoint_id=dcp_dir)
    loaded, made = {}, [optimizer]
    for kind in ("consolidated", "distributed"):
        m = _sharded()
        m.load_state_dict(model.state_dict())
        o, s = _optimizer(m)
        o = _offloaded(o, s, tier, tmp)
        made.append(o)
        if kind == "consolidated":
            local = stage_state.reshard_optimizer_state(
                stage_state.merge_optimizer_states([consolidated], order), o, _names(m), order
            )
            params = [p for g in o.param_groups for p in g["params"]]
            local["state"] = {
                i: {k: distribute_like(v, params[i]) for k, v in st.items()}
                for i, st in local["state"].items()
            }
            o.load_state_dict(local)
        else:
            saved = dcp_state.saved_keys(dcp_dir)
            template = {"optimizer_0": dcp_state.optimizer_template(o, _names(m), saved, "optimizer_0")}
            dcp_state.load_state(template, dcp_dir)
            dcp_state.load_flat_optimizer_state(o, _names(m), template["optimizer_0"])
        s.load_state_dict(scheduler.state_dict())
        _train(m, o, s, 2, start=2)
        loaded[kind] = _full(m)
    _train(model, optimizer, scheduler, 2, start=2)
    out[f"checkpoints_{tier}"] = (loaded, _full(model))
    for o in made:
        getattr(o, "close", lambda: None)()


def _hsdp(out: dict, tmp: Path) -> None:
    """HSDP (2 replicas of a 1-way shard, placements (Replicate(), Shard(0))): both tiers as without."""
    params = {}
    for tier in ("plain", "host", "disk"):
        model = _model()
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer, scheduler = _optimizer(model)
        if tier != "plain":
            optimizer = _offloaded(optimizer, scheduler, tier, tmp)
        _train(model, optimizer, scheduler, STEPS)
        params[tier] = _full(model)
        getattr(optimizer, "close", lambda: None)()
    out["hsdp"] = params


def _low_precision(out: dict, tmp: Path) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        out[str(dtype)] = _low_precision_run(dtype, tmp)


def _low_precision_run(dtype: torch.dtype, tmp: Path) -> tuple:
    """bf16 / fp16 shards: the host steps fp32 masters; the reference does the same on the device."""
    model, ref_model = _sharded(dtype), _sharded(dtype)
    optimizer, scheduler = _optimizer(model)
    optimizer = host_step_shards(optimizer, False, [scheduler])
    masters = {
        p: nn.Parameter(p.detach().to(torch.float32)) for p in ref_model.parameters() if p.requires_grad
    }
    groups = [
        {"params": [masters[p] for p in ref_model[2].parameters()]},
        {"params": [masters[p] for p in ref_model[4].parameters()], "lr": 0.02},
    ]
    ref = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1, fused=True)  # the host's kernel
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.7)
    disk_model = _sharded(dtype)
    disk, disk_scheduler = _optimizer(disk_model)
    disk = disk_step(disk, DiskTier(str(tmp / "scratch"), 2 * DISK_BUFFER), schedulers=[disk_scheduler])
    _train(model, optimizer, scheduler, STEPS)
    _train(disk_model, disk, disk_scheduler, STEPS)
    _train(ref_model, ref, ref_scheduler, STEPS, masters=masters)
    state = optimizer.state_dict()["state"]
    disk_state = _full_state(disk)
    disk.close()
    return (
        _full(disk_model),
        disk_state,
        _full_state(optimizer),
        _full(model),
        _full(ref_model),
        {
            n: full_tensors(optimizer.state[p][MASTER])
            for p, n in _names(model).items()
            if p in optimizer.state
        },
        {n: full_tensors(masters[p].detach()) for p, n in _names(ref_model).items() if p in masters},
        sorted(next(iter(state.values()))),
    )


# A few chunks of the shards' state (each rank steps ~180 elements; AdamW: 8 bytes each in the files).
DISK_BUFFER = 3000


def _disk_fsdp(out: dict, tmp: Path) -> None:
    """FSDP2 shards stepping from the files: as the host tier (bitwise) and the plain run (1e-5); the
    files in a directory per rank, gone at close."""
    model, host_model, plain_model = _sharded(), _sharded(), _sharded()
    optimizer, scheduler = _optimizer(model)
    tier = DiskTier(str(tmp / "scratch"), DISK_BUFFER)  # rank: the global one, a directory each
    optimizer = disk_step(optimizer, tier, schedulers=[scheduler])
    host, host_scheduler = _optimizer(host_model)
    host = host_step_shards(host, False, [host_scheduler])
    plain, plain_scheduler = _optimizer(plain_model)
    for m, o, s in ((model, optimizer, scheduler), (host_model, host, host_scheduler)):
        _train(m, o, s, STEPS)
    _train(plain_model, plain, plain_scheduler, STEPS)
    out["disk_fsdp"] = (_full(model), _full(host_model), _full(plain_model))
    out["disk_fsdp_state"] = (_full_state(optimizer), _full_state(plain))
    out["disk_fsdp_chunks"] = (sum(len(d.layout.chunks) for d in optimizer._disk), optimizer.buffers.peak)
    out["disk_dirs"] = sorted(p.name for p in (tmp / "scratch").iterdir())
    dist.barrier()  # (every rank has listed the directories before any removes its own)
    optimizer.close(keep_state=True)  # (a run that ended normally: a checkpoint may follow)
    dist.barrier()
    out["disk_dirs_after"] = sorted(p.name for p in (tmp / "scratch").iterdir())
    out["disk_fsdp_state_after_close"] = _full_state(optimizer)


def _zero1_disk(out: dict, tmp: Path) -> None:
    """ZeRO-1: each replica steps its shard of the state from its own rank's files."""
    runs = {}
    for kind in ("plain", "disk"):
        model = _model()
        optimizer, scheduler = _optimizer(model)
        if kind == "disk":
            tier = DiskTier(str(tmp / "zero_scratch"), DISK_BUFFER)
            optimizer = disk_step(optimizer, tier, dist.group.WORLD, shard=True, schedulers=[scheduler])
        else:
            optimizer = zero.shard_optimizer_state(optimizer, dist.group.WORLD, [scheduler])
        for step in range(STEPS):
            for x, y in _batches(step, torch.float32):
                (nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        zero.consolidate(optimizer)
        state = copy.deepcopy(optimizer.state_dict()) if dist.get_rank() == 0 else None
        runs[kind] = (
            {k: v.clone() for k, v in model.state_dict().items()},
            state,
            type(optimizer.optim).__name__,
        )
        if kind == "disk":
            optimizer.optim.close(keep_state=True)  # the files gone, the shard's state on the host
            zero.consolidate(optimizer)
            runs["disk_after_close"] = copy.deepcopy(optimizer.state_dict()) if dist.get_rank() == 0 else None
    out["zero1"] = runs
    dist.barrier()
    out["zero_dirs_after"] = sorted(p.name for p in (tmp / "zero_scratch").iterdir())


def _job(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    out: dict = {}
    for scratch in ("scratch", "zero_scratch"):
        (Path(out_dir) / scratch).mkdir(exist_ok=True)
    _host_tier(out)
    for tier in ("host", "disk"):
        _checkpoint_paths(out, Path(out_dir), tier)
    _hsdp(out, Path(out_dir))
    _low_precision(out, Path(out_dir))
    _disk_fsdp(out, Path(out_dir))
    _zero1_disk(out, Path(out_dir))
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def _same(actual: dict, expected: dict, bitwise: bool = False, what: str = "") -> None:
    assert set(actual) == set(expected)
    for k in expected:
        if bitwise:
            assert torch.equal(actual[k], expected[k]), k
        torch.testing.assert_close(
            actual[k], expected[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what} {k}: {m}"
        )


def test_fsdp2_shards_train_as_without_offload_with_the_optimizer_on_the_host_or_the_disk(tmp_path):
    records = spawn_gloo(_job, 2, tmp_path)
    for out in records:
        _check_host_tier(out)
        _check_disk_tier(out)


def _check_disk_tier(out: dict) -> None:
    disk, host, plain = out["disk_fsdp"]
    _same(disk, host, bitwise=True, what="disk against host")
    _same(disk, plain, what="disk against plain")
    live, theirs = out["disk_fsdp_state"]
    for when, mine in (("", live), ("after close ", out["disk_fsdp_state_after_close"])):
        assert mine["param_groups"] == theirs["param_groups"]
        assert sorted(mine["state"]) == sorted(theirs["state"]) == [2, 3, 4, 5]
        for i, state in theirs["state"].items():
            _same(mine["state"][i], state, what=f"{when}state {i}")
    chunks, peak = out["disk_fsdp_chunks"]
    assert chunks > 2 and 0 < peak <= DISK_BUFFER
    assert out["disk_dirs"] == ["rank0", "rank1"], "a directory per rank: the ranks of a node never collide"
    assert out["disk_dirs_after"] == []
    assert out["zero_dirs_after"] == []
    runs = out["zero1"]
    _same(runs["disk"][0], runs["plain"][0], what="zero1")
    assert runs["disk"][2] == "AdamW"
    if runs["plain"][1] is not None:  # rank 0: the consolidated state, as ZeRO-1 without the disk
        theirs = runs["plain"][1]
        for when, mine in (("", runs["disk"][1]), ("after close ", runs["disk_after_close"])):
            assert mine["param_groups"] == theirs["param_groups"]
            assert sorted(mine["state"]) == sorted(theirs["state"]) == [2, 3, 4, 5]
            for i, state in theirs["state"].items():
                _same(mine["state"][i], state, what=f"zero1 {when}state {i}")


def _check_host_tier(out: dict) -> None:
    if True:
        # The host step reads the clipped gradients: the norms (before clipping) and parameters agree.
        assert out["norms"][0] == pytest.approx(out["norms"][1], rel=1e-6)
        _same(*out["params"])
        assert out["lrs"][0] == out["lrs"][1]
        assert out["types"] == ("AdamW", True)
        assert out["host_state"], "the state lives in host tensors of its own"
        mine, theirs = out["state"]
        assert mine["param_groups"] == theirs["param_groups"]
        assert sorted(mine["state"]) == sorted(theirs["state"]) == [2, 3, 4, 5]  # the frozen 0, 1: none
        for i, state in theirs["state"].items():
            _same(mine["state"][i], state)
        resumed, expected = out["resumed"]
        for name, params in resumed.items():
            _same(params, expected, what=name)
        for tier in ("host", "disk"):
            loaded, expected = out[f"checkpoints_{tier}"]
            for kind, params in loaded.items():
                _same(params, expected, bitwise=True, what=f"{tier} resumed from the {kind} state")
        hsdp = out["hsdp"]
        _same(hsdp["host"], hsdp["plain"], what="hsdp host")
        _same(hsdp["disk"], hsdp["host"], bitwise=True, what="hsdp disk")
        for dtype in ("torch.bfloat16", "torch.float16"):
            disk_params, disk_state, host_state, params, ref_params, master, ref_master, keys = out[dtype]
            _same(disk_params, params, bitwise=True, what=f"{dtype} disk")
            for i, state in host_state["state"].items():
                _same(disk_state["state"][i], state, bitwise=True, what=f"{dtype} disk state {i}")
            _same(params, ref_params, bitwise=True, what=dtype)
            _same(master, ref_master, bitwise=True, what=dtype)
            assert keys == ["exp_avg", "exp_avg_sq", MASTER, "step"]
