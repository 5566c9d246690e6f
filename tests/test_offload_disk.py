"""The disk tier (techniques/offload/disk_optimizer.py, with techniques/offload/disk_tier.py (its settings
and its buffer's split), techniques/offload/disk_layout.py, techniques/offload/disk_group.py,
techniques/offload/disk_chunk.py, techniques/offload/disk_stream.py and techniques/offload/scratch.py):
the optimizer state in files, streamed through a bounded host buffer.

In one process, no process group (the FSDP2 and ZeRO-1 runs are in test_offload_shards.py's spawned
job): the chunk plan; replicas stepping from the files against the plain optimizer (1e-5) and against
the host tier (bitwise: the same fused kernel, tensors split at multiples of 64 elements); bf16
parameters against the host tier's fp32 masters (bitwise); the host buffers' measured peak; the state
dict both ways and a resume; the scratch semantics (files gone at close, a killed run's directory
emptied and never read, a live one refused); and the refusals and faults, each with its message.
"""

from __future__ import annotations

import copy
import errno
import gc
import os
import signal
import time

import pytest
import torch
from torch import nn

from lightning_parallel.techniques.offload import scratch
from lightning_parallel.techniques.offload.disk_layout import (
    SPLIT,
    StateKey,
    plan_group,
    probe_keys,
    probe_start,
)
from lightning_parallel.techniques.offload.disk_optimizer import DiskStepping, DiskTier, disk_step
from lightning_parallel.techniques.offload.disk_stream import SLOTS
from lightning_parallel.techniques.offload.host_optimizer import host_step
from lightning_parallel.techniques.offload.scratch import DiskFullError, ScratchDir
from lightning_parallel.techniques.offload.shard_optimizer import MASTER, host_step_shards

STEPS = 4
BUFFER = (
    8 * 1024
)  # bytes: chunks of ~240 elements for the model's 2152 trainable ones (AdamW: 17 KiB of state)


# --------------------------------------------------------------------------------------- the layout
def test_chunks_split_tensors_at_multiples_of_64_elements_or_never():
    adam = (StateKey("exp_avg", torch.float32), StateKey("exp_avg_sq", torch.float32))
    layout = plan_group([300, None, 10, 0, 70], adam, 128, split=True)
    pieces = [[(p.index, p.start, p.numel) for p in c.pieces] for c in layout.chunks]
    assert pieces == [[(0, 0, 128)], [(0, 128, 128)], [(0, 256, 44), (2, 0, 10), (3, 0, 0), (4, 0, 70)]]
    assert all(p.start % SPLIT == 0 for c in layout.chunks for p in c.pieces)
    assert [c.offset for c in layout.chunks] == [0, 4096, 8192]
    assert layout.chunks[1].key_offset(adam, 1) == 512 and layout.chunks[1].nbytes(adam) == 1024
    assert [(c.offset, p.start) for c, p in layout.pieces_of(0)] == [(0, 0), (4096, 128), (8192, 256)]
    whole = plan_group([100, 10, 20], adam, 128, split=False)
    assert [[p.index for p in c.pieces] for c in whole.chunks] == [[0, 1], [2]]
    with pytest.raises(
        ValueError, match=r"a parameter of 300 elements does not fit .* raise the buffer to 2.3x"
    ):
        plan_group([300], adam, 128, split=False)
    keys, elementwise = probe_keys(torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, {}, torch.float32)
    assert [k.name for k in keys] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"] and elementwise
    assert probe_keys(torch.optim.SGD, {"lr": 0.1}, {}, torch.float32) == ((), True)  # no momentum: no state
    with pytest.raises(ValueError, match=r"Adafactor keeps 'row_var' of shape \(2, 1\) .* offload its state"):
        probe_keys(torch.optim.Adafactor, {"lr": 0.1}, {}, torch.float32)


# ------------------------------------------------------------------------------------- the replicas
def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 2))
    model[0].requires_grad_(False)  # frozen (a LoRA base): no room in the files, no state
    return model.to(dtype)


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_without_state": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.05, amsgrad=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
}


def _build(model: nn.Module, name: str, tier: str | None, directory=None, buffer: int = BUFFER):
    groups = [{"params": [*model[0].parameters(), *model[2].parameters()]}, {"params": model[4].parameters()}]
    groups[1]["lr"] = 0.02
    optimizer = OPTIMIZERS[name](groups)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    if tier == "host":
        optimizer = host_step(optimizer, None, False, False, [scheduler])
    elif tier == "masters":  # fp32 masters of bf16 parameters on the host
        optimizer = host_step_shards(optimizer, False, [scheduler])
    elif tier == "disk":
        optimizer = disk_step(optimizer, DiskTier(str(directory), buffer, rank=0), schedulers=[scheduler])
    return optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int, start: int = 0) -> list[float]:
    """Accumulation (two backwards) and clipping on the "device" gradients, then the step."""
    seconds = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        for _ in range(2):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
            nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        begin = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - begin)
        optimizer.zero_grad()
        scheduler.step()
    return seconds


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_replicas_step_from_the_files_as_the_plain_and_the_host_optimizer(name, tmp_path):
    (plain_model, disk_model, host_model) = (_mlp(), _mlp(), _mlp())
    plain, plain_scheduler = _build(plain_model, name, None)
    optimizer, scheduler = _build(disk_model, name, "disk", tmp_path)
    host, host_scheduler = _build(host_model, name, "host")
    assert type(optimizer).__name__ == type(plain).__name__ and isinstance(optimizer, type(plain))
    _train(plain_model, plain, plain_scheduler, STEPS)
    _train(disk_model, optimizer, scheduler, STEPS)
    _train(host_model, host, host_scheduler, STEPS)
    for got, want in zip(disk_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert _equal(disk_model, host_model), "a chunk steps bitwise as the whole tensors do"
    assert sum(len(d.layout.chunks) for d in optimizer._disk) > 2, "the state streamed in several chunks"
    # The host held its buffers only: at most their size, well under the state's (the files' size).
    assert 0 < optimizer.buffers.peak <= BUFFER
    assert name.startswith("sgd") or optimizer.disk_bytes() > 2 * BUFFER
    mine, theirs = optimizer.state_dict(), plain.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert sorted(mine["state"]) == sorted(theirs["state"])
    assert sorted(theirs["state"]) == (
        [] if name == "sgd_without_state" else [2, 3, 4, 5]
    )  # frozen 0, 1: none
    for i, state in theirs["state"].items():
        assert state.keys() == mine["state"][i].keys()
        for key, value in state.items():
            torch.testing.assert_close(mine["state"][i][key], value, rtol=1e-5, atol=1e-7)
    optimizer.close()
    assert os.listdir(tmp_path) == [], "the files and the rank's directory are scratch: gone at close"


def test_a_first_state_is_made_in_the_buffer_where_the_class_starts_from_zeros(tmp_path):
    f32 = torch.float32
    assert probe_start(torch.optim.AdamW, {"lr": 0.1}, {"fused": True}, f32) == {"step": torch.tensor(0.0)}
    assert probe_start(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {}, f32) == {}  # (no dampening)
    assert probe_start(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}, {}, f32) is None
    assert probe_start(torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}, {}, f32) is None
    cases = ((torch.optim.AdamW, {"lr": 0.05}, True), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
             "dampening": 0.1}, False))  # fmt: skip
    for cls, hyper, in_slot in cases:
        first_states: list[list[bool]] = []
        model = _mlp()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = disk_step(
            _watched(cls, first_states)(trainable, **hyper), DiskTier(str(tmp_path), 9 * BUFFER, rank=0)
        )
        first_states.clear()  # (the probe steps')
        _train(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), 1)
        # (a subclass is not known to step elementwise: whole tensors in a chunk, a larger buffer)
        assert first_states and all(all(s) == in_slot for s in first_states), (cls, first_states)
        optimizer.close()


def _watched(cls: type, first_states: list[list[bool]]) -> type:
    """``cls`` noting, at each step, whether each parameter's state was there before it (the chunks')."""

    class Watched(cls):
        def step(self, closure=None):
            params = [p for g in self.param_groups for p in g["params"]]
            first_states.append([bool(self.state[p]) for p in params])
            return super().step(closure)

    return Watched


def test_the_state_dict_loads_both_ways_and_a_resume_is_the_uninterrupted_run(tmp_path):
    plain_model, disk_model = _mlp(), _mlp()
    plain, plain_scheduler = _build(plain_model, "adamw", None)
    for name in "abc":
        (tmp_path / name).mkdir()
    optimizer, scheduler = _build(disk_model, "adamw", "disk", tmp_path / "a")
    _train(plain_model, plain, plain_scheduler, 2)
    _train(disk_model, optimizer, scheduler, 2)
    resumed = {}
    for name, source, tier, directory in (
        ("disk_to_plain", optimizer, None, None),
        ("plain_to_disk", plain, "disk", tmp_path / "b"),
        ("disk_to_disk", optimizer, "disk", tmp_path / "c"),
    ):
        model = _mlp()
        model.load_state_dict(disk_model.state_dict())
        o, s = _build(model, "adamw", tier, directory)
        o.load_state_dict(copy.deepcopy(source.state_dict()))
        s.load_state_dict(scheduler.state_dict())
        _train(model, o, s, 2, start=2)
        resumed[name] = model
    _train(disk_model, optimizer, scheduler, 2, start=2)
    _train(plain_model, plain, plain_scheduler, 2, start=2)
    assert _equal(resumed["disk_to_disk"], disk_model), "a resume continues bitwise"
    for model in resumed.values():
        for got, want in zip(model.parameters(), plain_model.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_0_dim_parameter_and_a_state_of_another_optimizer(tmp_path):
    """A scalar parameter (a learnable temperature) steps and round-trips; amsgrad's state into AdamW's
    layout is refused with the keys."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.randn(70))]
    plain_params = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = disk_step(torch.optim.AdamW(params, lr=0.1), DiskTier(str(tmp_path), BUFFER))
    plain = torch.optim.AdamW(plain_params, lr=0.1)
    for _ in range(3):
        for ps, o in ((params, optimizer), (plain_params, plain)):
            (ps[0] * ps[1].sum()).square().backward()
            o.step()
            o.zero_grad()
    for got, want in zip(params, plain_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    saved = optimizer.state_dict()
    assert saved["state"][0]["exp_avg"].shape == () and saved["state"][1]["exp_avg"].shape == (70,)
    optimizer.load_state_dict(copy.deepcopy(plain.state_dict()))
    for i, state in plain.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optimizer.state_dict()["state"][i][key], value, rtol=1e-6, atol=1e-7)
    amsgrad = copy.deepcopy(plain.state_dict())
    amsgrad["state"][1]["max_exp_avg_sq"] = torch.zeros(70)
    with pytest.raises(
        ValueError, match=r"keeps \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\] .* keeps"
    ):
        optimizer.load_state_dict(amsgrad)
    optimizer.close()


def test_bf16_parameters_step_as_fp32_masters_kept_in_the_files(tmp_path):
    """The master (fp32) is in the files; the bf16 parameter is its rounding; both as the host tier's."""
    disk_model, host_model = _mlp(torch.bfloat16), _mlp(torch.bfloat16)
    optimizer, scheduler = _build(disk_model, "adamw", "disk", tmp_path)
    host, host_scheduler = _build(host_model, "adamw", "masters")
    _train(disk_model, optimizer, scheduler, STEPS)
    _train(host_model, host, host_scheduler, STEPS)
    assert _equal(disk_model, host_model)
    mine, theirs = optimizer.state_dict()["state"], host.state_dict()["state"]
    assert sorted(mine) == sorted(theirs) == [2, 3, 4, 5]
    for i, state in theirs.items():
        assert sorted(mine[i]) == sorted(state) == ["exp_avg", "exp_avg_sq", MASTER, "step"]
        for key, value in state.items():
            assert torch.equal(mine[i][key], value), (i, key)
    assert mine[2][MASTER].dtype == torch.float32 and not torch.equal(
        mine[2][MASTER], mine[2][MASTER].bfloat16()
    )
    # Weights loaded from elsewhere (no longer the master's rounding): the master is taken from them.
    with torch.no_grad():
        disk_model[2].weight.add_(1.0)
    _train(disk_model, optimizer, scheduler, 1, start=STEPS)
    assert torch.equal(optimizer.state[disk_model[2].weight][MASTER].bfloat16(), disk_model[2].weight)
    optimizer.close()


# -------------------------------------------------------------------------------- scratch semantics
def _fork(child) -> tuple[int, int]:
    """A child process running ``child(write_fd)``, then waiting to be killed; (its pid, a read fd)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read)
            child(write)
            os.write(write, b"ready")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 5) == b"ready"
    return pid, read


def _hold(root: str):
    def child(_: int) -> None:
        held = ScratchDir.acquire(root, rank=0)
        held.new_file(4096, unnamed=False)  # a named file: what a kill leaves behind
        held.new_file(4096, unnamed=None)  # an unnamed one: the kernel frees it

    return child


def test_a_killed_runs_directory_is_emptied_and_never_read_a_live_one_is_refused(tmp_path):
    ScratchDir._held.clear()  # (a forked child must not believe it holds what this process holds)
    pid, pipe = _fork(_hold(str(tmp_path)))
    try:
        with pytest.raises(
            ValueError, match=rf"{tmp_path}/rank0' is in use by process {pid} on .*: give each"
        ):
            _build(_mlp(), "adamw", "disk", tmp_path)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(pipe)
    left = sorted(os.listdir(tmp_path / "rank0"))
    assert len(left) == 2 and left[0] == "lock" and left[1].endswith(".state")
    model, plain_model = _mlp(), _mlp()
    optimizer, scheduler = _build(model, "adamw", "disk", tmp_path)
    assert optimizer._scratch.stale == [str(tmp_path / "rank0" / left[1])]
    assert len(optimizer.state) == 0, "the killed run's files are scratch: never read as a state"
    plain, plain_scheduler = _build(plain_model, "adamw", None)
    _train(model, optimizer, scheduler, 2)
    _train(plain_model, plain, plain_scheduler, 2)
    for got, want in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Named files while it runs (unnamed=False), gone with the directory at the end.
    assert [n for n in os.listdir(tmp_path / "rank0") if n != "lock"] == []  # unnamed here: no names
    optimizer.close()
    assert os.listdir(tmp_path) == []
    named = disk_step(
        _build(_mlp(), "adamw", None)[0], DiskTier(str(tmp_path), BUFFER, rank=3, unnamed=False)
    )
    assert sorted(os.listdir(tmp_path / "rank3"))[0] == "lock" and len(os.listdir(tmp_path / "rank3")) == 3
    named.close()
    assert os.listdir(tmp_path) == []
    model = _mlp()
    dropped, scheduler = _build(model, "adamw", "disk", tmp_path)  # (the two reference each other)
    _train(model, dropped, scheduler, 1)
    del dropped, scheduler
    gc.collect()
    assert os.listdir(tmp_path) == [], "an optimizer dropped without close() leaves nothing either"


# ----------------------------------------------------------------------------- refusals and faults
def test_bad_directories_and_a_disk_without_room_are_refused_before_any_step(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"offload_dir '.*missing' does not exist: create it"):
        _build(_mlp(), "adamw", "disk", tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"offload_dir '.*file' is not a directory"):
        _build(_mlp(), "adamw", "disk", tmp_path / "file")

    def not_writable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    with monkeypatch.context() as m:  # (this suite runs as root, whom a chmod does not stop)
        m.setattr(scratch.tempfile, "TemporaryFile", not_writable)
        with pytest.raises(ValueError, match=r"offload_dir '.*' is not writable \(Permission denied\)"):
            _build(_mlp(), "adamw", "disk", tmp_path)
    fits, _ = _build(_mlp(), "adamw", "disk", tmp_path)
    needed = fits.disk_bytes()
    fits.close()
    assert needed >= 8 * (40 * 50 + 50 + 50 * 2 + 2)  # AdamW: 8 bytes per trainable element
    with monkeypatch.context() as m:
        m.setattr(scratch.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
        with pytest.raises(
            ValueError, match=rf"needs .* \({needed} bytes\) .* has 1000 B \(1000 bytes\) free"
        ):
            _build(_mlp(), "adamw", "disk", tmp_path)
    assert os.listdir(tmp_path) == ["file"], "a refused optimizer leaves no scratch behind"
    least = 3 * 64 * 2 + 3 * 64 + 64 * (3 * 8 + 8)  # aligned regions; 64 elements: 3 slots, work area
    with pytest.raises(
        ValueError, match=rf"host buffer of 100 bytes holds 0 elements .* at least {least} bytes"
    ):
        _build(_mlp(), "adamw", "disk", tmp_path, buffer=100)
    model = _mlp()
    stepped, scheduler = _build(model, "adamw", None)
    _train(model, stepped, scheduler, 1)
    with pytest.raises(ValueError, match="already holds state: offload it right after it is built"):
        disk_step(stepped, DiskTier(str(tmp_path)))
    assert os.listdir(tmp_path) == ["file"]


def test_a_disk_that_fills_during_a_step_ends_it_with_the_message(tmp_path, monkeypatch):
    model = _mlp()
    optimizer, scheduler = _build(model, "adamw", "disk", tmp_path)
    _train(model, optimizer, scheduler, 1)

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(scratch.os, "pwritev", full)
        with pytest.raises(
            DiskFullError, match=r"the disk under offload_dir '.*' filled .* resume from the last"
        ):
            _train(model, optimizer, scheduler, 1, start=1)
    with pytest.raises(RuntimeError, match=r"failed in an earlier step .* resume from the last checkpoint"):
        _train(model, optimizer, scheduler, 1, start=2)
    optimizer.close()
    assert os.listdir(tmp_path) == []
    assert isinstance(optimizer, DiskStepping) and SLOTS == 3


def test_a_parameter_unfrozen_after_the_layout_is_refused_a_new_group_is_laid_out(tmp_path):
    model = _mlp()
    optimizer, scheduler = _build(model, "adamw", "disk", tmp_path)
    model[0].requires_grad_(True)
    with pytest.raises(
        ValueError, match=r"shape \(40, 6\) was frozen when the optimizer was built .* new param"
    ):
        _train(model, optimizer, scheduler, 1)
    optimizer.close()
    # BackboneFinetuning's way: the backbone out of the optimizer, then added as a group of its own
    # (laid out when it is added).
    optimizer, _ = _backbone_joins(tmp_path, BUFFER, head=2, backbone=lambda m: [m[0].weight])
    assert len(optimizer._disk) == 2 and optimizer._disk[1].has_state(0)
    optimizer.close()


def _backbone_joins(tmp_path, buffer: int, head: int, backbone) -> tuple:
    """The disk tier and a plain AdamW over ``model[head:]``, one step; then ``backbone(model)`` (the first
    layer unfrozen) added as a group of its own and two more steps, the disk tier's parameters checked
    against the plain one's. Returns the disk tier's optimizer and its buffers' peak before the group."""
    model, plain_model = _mlp(), _mlp()
    optimizer = disk_step(
        torch.optim.AdamW(model[head:].parameters(), lr=0.05), DiskTier(str(tmp_path), buffer)
    )
    plain = torch.optim.AdamW(plain_model[head:].parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.7)
    _train(model, optimizer, scheduler, 1)
    _train(plain_model, plain, plain_scheduler, 1)
    before = optimizer.buffers.peak
    for m, o in ((model, optimizer), (plain_model, plain)):
        m[0].requires_grad_(True)
        o.add_param_group({"params": backbone(m), "lr": 0.01})
    _train(model, optimizer, scheduler, 2, start=1)
    _train(plain_model, plain, plain_scheduler, 2, start=1)
    for got, want in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return optimizer, before


def test_the_buffer_holds_what_the_groups_need_and_grows_when_a_larger_group_joins(tmp_path):
    """A 64 MiB buffer for a head of 102 trainable elements: the tier holds the head's chunk, not 64 MiB;
    the backbone added as a group (BackboneFinetuning's way) grows it, and the steps stay exact."""
    backbone = lambda m: [*m[0].parameters(), *m[2].parameters()]  # noqa: E731
    optimizer, head = _backbone_joins(tmp_path, 64 * 2**20, head=4, backbone=backbone)
    assert 0 < head < 64 * 1024, head  # (3 slots of 64 elements x 8 bytes of AdamW state, a work area)
    assert head < optimizer.buffers.peak < 256 * 1024  # (the backbone's 2,320 elements in one chunk)
    assert [len(d.layout.chunks) for d in optimizer._disk] == [1, 1]
    optimizer.close()
