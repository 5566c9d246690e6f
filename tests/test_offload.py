"""Offload (techniques/offload/, the technique in techniques/offload/technique.py, its checks in
techniques/offload/checks.py): the optimizer step, FSDP2's shards and the activations on the host.

What only offload has: the host-stepping optimizer against the plain one, the host kernel, the
activation hooks, the memory arithmetic, the refusals, and one device (pipeline_size=1) under fp32 and
bf16-mixed. Every multi-process configuration (each offload target with the replicas, ZeRO-1, FSDP2 and
HSDP, every schedule, recomputation, 16-mixed, validation, prediction and resumes) is a case of the
configuration matrix (tests/matrix.py, run by tests/test_matrix.py), with offload's own check there
(tests/matrix_checks.py: the frozen parameters without state or host copy, where the state and the step
live, the activations in flight on the host). On this CPU-only machine host and device are the same
memory: the copies are real, separate tensors.
"""

from __future__ import annotations

import copy
import errno
from pathlib import Path

import pytest
import torch
from mp_harness import (
    SaveAtEpochEnd,
    assert_close_dicts,
    fit,
    quiet_trainer,
)
from tiny_models import SequentialRegressor, loader, regression_data
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from lightning_parallel import PipelineStrategy
from lightning_parallel.optim.home import home_device
from lightning_parallel.techniques.offload import scratch
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.host_optimizer import (
    host_kernel,
    host_step,
    is_host_stepping,
    use_host_kernels,
)
from lightning_parallel.techniques.offload.memory import memory

STEPS = 4


# ------------------------------------------------------------------ the host-stepping optimizer, alone
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    model[0].requires_grad_(False)  # frozen (a LoRA base): no host copy, no state
    return model


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.05, amsgrad=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
}


def _build(model: nn.Module, name: str, host: bool):
    groups = [{"params": model[0].parameters()}, {"params": model[2:].parameters(), "lr": 0.02}]
    optimizer = OPTIMIZERS[name](groups)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    if host:
        optimizer = host_step(optimizer, None, False, False, [scheduler])
    return optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_host_stepping_steps_as_the_plain_optimizer_and_keeps_its_state_dict(name):
    model, plain_model = _mlp(), _mlp()
    optimizer, scheduler = _build(model, name, host=True)
    plain, plain_scheduler = _build(plain_model, name, host=False)
    assert type(optimizer).__name__ == type(plain).__name__ and isinstance(optimizer, type(plain))
    _train(model, optimizer, scheduler, STEPS)
    _train(plain_model, plain, plain_scheduler, STEPS)
    assert_close_dicts(model.state_dict(), plain_model.state_dict(), rtol=1e-6, atol=1e-7)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in plain.param_groups]
    # The user's state dict: same ids, groups (the user's fused/foreach too) and state keys.
    mine, theirs = optimizer.state_dict(), plain.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert sorted(mine["state"]) == sorted(theirs["state"]) == [2, 3, 4, 5]  # the frozen 0, 1: none
    for i, state in theirs["state"].items():
        assert_close_dicts(mine["state"][i], state, rtol=1e-6, atol=1e-7)
    # The host step's copies are separate tensors (on a GPU: on the host), the frozen weight has none.
    copies = [c for group in optimizer._copies for c in group]
    assert [c is None for c in copies] == [True, True, False, False, False, False]
    assert all(c.host.data_ptr() != c.device.data_ptr() for c in copies if c is not None)
    assert not any(p in optimizer.state for p in model[0].parameters())


def test_state_dicts_load_both_ways_and_written_parameters_are_taken():
    """A host-stepping state loads into the plain optimizer and back; a model loaded between steps (a
    checkpoint's weights) is what the host step continues from."""
    model, plain_model = _mlp(), _mlp()
    optimizer, scheduler = _build(model, "adamw", host=True)
    plain, plain_scheduler = _build(plain_model, "adamw", host=False)
    _train(model, optimizer, scheduler, 2)
    _train(plain_model, plain, plain_scheduler, 2)
    resumed_model, resumed_plain_model = _mlp(), _mlp()
    resumed, resumed_scheduler = _build(resumed_model, "adamw", host=True)
    resumed_plain, resumed_plain_scheduler = _build(resumed_plain_model, "adamw", host=False)
    resumed.load_state_dict(copy.deepcopy(plain.state_dict()))  # plain -> host
    resumed_plain.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # host -> plain
    for sched in (resumed_scheduler, resumed_plain_scheduler):
        sched.load_state_dict(scheduler.state_dict())
    resumed_model.load_state_dict(model.state_dict())  # after the host copies were made: taken at step
    resumed_plain_model.load_state_dict(model.state_dict())
    assert all(v.device.type == "cpu" for s in resumed.state.values() for v in s.values())
    _train(resumed_model, resumed, resumed_scheduler, 2, start=2)
    _train(resumed_plain_model, resumed_plain, resumed_plain_scheduler, 2, start=2)
    _train(plain_model, plain, plain_scheduler, 2, start=2)
    assert_close_dicts(resumed_model.state_dict(), plain_model.state_dict(), rtol=1e-6, atol=1e-7)
    assert_close_dicts(resumed_plain_model.state_dict(), plain_model.state_dict(), rtol=1e-6, atol=1e-7)
    # Where a loaded state goes (checkpoint loading asks the optimizer, not the plan): the host.
    device = torch.device("cuda", 0)
    assert (
        home_device(resumed, device) == torch.device("cpu") and home_device(resumed_plain, device) == device
    )
    use_host_kernels(resumed_plain)  # (an optimizer over FSDP2's host shards)
    assert home_device(resumed_plain, device) == torch.device("cpu")


def test_the_host_kernel_is_the_fastest_one_the_class_has_and_optimizers_without_one_are_refused(one_rank):
    fused_adamw = {"fused": True, "foreach": False, "capturable": False}
    assert host_kernel(torch.optim.AdamW, {"lr": 0.1}) == fused_adamw
    assert host_kernel(torch.optim.SGD, {"lr": 0.1}) == {"fused": True, "foreach": False}
    assert host_kernel(torch.optim.RMSprop, {"lr": 0.1}) == {"foreach": True, "capturable": False}

    class CudaOnly(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("this optimizer runs on CUDA only")

    for cls, error in [(torch.optim.LBFGS, "TypeError"), (CudaOnly, "RuntimeError: this optimizer runs")]:
        with pytest.raises(ValueError, match=rf"runs {cls.__name__}'s step on the host, .*\({error}"):
            host_step(cls(_mlp().parameters(), lr=0.1), None, False, False)
    model = _mlp()
    stepped, scheduler = _build(model, "sgd", host=False)
    _train(model, stepped, scheduler, 1)
    with pytest.raises(ValueError, match="already holds state: offload it right after it is built"):
        host_step(stepped, None, False, False)
    # DTensor parameters (a parallelize_fn's split weights) have no whole-tensor host copy yet.
    mesh = init_device_mesh("cpu", (1,))
    split = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"holds DTensor parameters .* not supported yet"):
        host_step(torch.optim.AdamW([split]), None, False, False)
    # FSDP2's offloaded shards are DTensors: the kernel is probed on one (torch 2.13 has no sharding rule
    # for the fused SGD kernel), and steps them as one device steps the whole tensors.
    assert host_kernel(torch.optim.SGD, {"lr": 0.1}, like=split) == {"fused": False, "foreach": True}
    assert host_kernel(torch.optim.AdamW, {"lr": 0.1}, like=split) == fused_adamw
    whole = nn.Parameter(torch.randn(4, 2))
    shard = nn.Parameter(distribute_tensor(whole.detach().clone(), mesh, [Shard(0)]))
    sgd = [torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1) for p in (whole, shard)]
    use_host_kernels(sgd[1])
    for step in range(2):
        whole.grad = torch.full_like(whole, step + 1.0)
        shard.grad = distribute_tensor(whole.grad.clone(), mesh, [Shard(0)])
        sgd[0].step()
        sgd[1].step()
    torch.testing.assert_close(shard.full_tensor(), whole.detach(), rtol=0, atol=0)
    # The GradScaler unscales the device gradients before a fused optimizer's host step.
    fused = host_step(torch.optim.AdamW(_mlp().parameters(), fused=True), None, False, False)
    assert is_host_stepping(fused) and not fused._step_supports_amp_scaling


# ------------------------------------------------------------------------------------ activations, alone
class _Stage(nn.Module):
    """Two units, the second recomputed (torch's non-reentrant checkpoint keeps its input)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        return checkpoint(self.b, self.a(x), use_reentrant=False).sum()


def test_activations_in_flight_live_on_the_host_and_leave_with_their_backward():
    """Three micro-batches forward (in flight together), then their backwards: everything saved but the
    parameters went to the host, the recomputed unit's kept input too; the gradients are unchanged."""
    stage = _Stage()
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        expected = [torch.autograd.grad(stage(x), list(stage.parameters())) for x in xs[:1]]
    activations = {id(t): t.nbytes for t in saved if t._base is None or not isinstance(t._base, nn.Parameter)}
    # a's input and its tanh's output, which is b's input too (kept by the checkpoint): saved three times
    assert len(activations) == 2 and sum(activations.values()) == 3 * 4 * 4 + 3 * 8 * 4
    hooks = ActivationOffload()
    with hooks:
        losses = [stage(x) for x in xs]
    assert hooks.packed == 3 * 2 and hooks.live_bytes == hooks.peak_bytes == 3 * (3 * 4 * 4 + 3 * 8 * 4)
    grads = []
    for loss in losses:
        grads.append(torch.autograd.grad(loss, list(stage.parameters())))
    del losses
    assert hooks.live_bytes == 0
    for got, want in zip(grads[0], expected[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_memory_moves_what_each_offload_takes_to_the_host():
    sizes = dict(parameters=100, gradients=100, optimizer=200, trainable=100, activations=30, in_flight=4)
    assert memory((), **sizes).device == 520
    assert memory(("optimizer",), **sizes) == (memory((), **sizes).__class__(320, 400))
    both = memory(("activations", "optimizer", "parameters"), **sizes, gathered=250)
    assert (both.device, both.host) == (250 + 30, 400 + 120)


# ------------------------------------------------------------------------------------------ refusals
def test_offload_is_refused_where_it_cannot_work_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"offload=\['optimizer'\] with tensor_parallel_size=2 is not supp"):
        PipelineStrategy(offload="optimizer", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"offload='parameters' with a parallelize_fn is not supported"):
        PipelineStrategy(offload="parameters", data_parallel="fsdp", parallelize_fn=lambda stage, mesh: None)
    cases = [
        (dict(offload="optimizer", offload_pin_memory=True), FrozenFirst, r"offload_pin_memory=True page-"),
        (dict(offload="optimizer"), LbfgsRegressor, r"runs LBFGS's step on the host, but it failed"),
    ]
    for kwargs, model_cls, message in cases:
        trainer = quiet_trainer(devices=1, max_steps=1, strategy=PipelineStrategy(pipeline_size=1, **kwargs),
                                default_root_dir=tmp_path)  # fmt: skip
        with pytest.raises(ValueError, match=message):
            trainer.fit(model_cls(), loader(regression_data(8), 4))


# ------------------------------------------------------------------------- one device, bf16, resumes
class FrozenFirst(SequentialRegressor):
    """The job's model: an MLP whose first layer is frozen (a LoRA base); AdamW over all parameters."""

    def __init__(self) -> None:
        super().__init__(hidden=16, depth=5, adam=True)
        self.layers[0].requires_grad_(False)


class LbfgsRegressor(FrozenFirst):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


GLOBAL_BATCH = 16
TRAIN = dict(gradient_clip_val=0.5, accumulate_grad_batches=2, num_sanity_val_steps=0)
DATA = regression_data(48)


def test_one_device_and_bf16_mixed_train_as_without_offload(tmp_path):
    """pipeline_size=1 on one device: the optimizer and the activations on the host, and the optimizer
    state on the disk (its scratch gone once the run ended), fp32 and bf16-mixed (the fp32 masters)."""
    disk = dict(offload="optimizer", offload_to="disk", offload_dir=str(tmp_path), offload_buffer="1MiB")
    for precision in ("32-true", "bf16-mixed"):
        runs = {}
        host = dict(offload=["optimizer", "activations"])
        for name, options in (("none", {}), ("host", host), ("disk", disk)):
            torch.manual_seed(0)
            strategy = PipelineStrategy(pipeline_size=1, num_microbatches=4, **options)
            out = tmp_path / f"{precision}-{name}"
            runs[name] = fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH), out, strategy=strategy,
                             max_epochs=1, precision=precision, **TRAIN)[0]  # fmt: skip
        for name in ("host", "disk"):
            assert_close_dicts(runs[name]["params"], runs["none"]["params"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(runs[name]["losses"], runs["none"]["losses"], rtol=1e-5, atol=1e-6)
        assert not (tmp_path / "rank0").exists()  # (the disk tier's scratch, removed at the end of the run)


def test_the_disk_tier_refuses_a_bad_directory_before_any_step_and_a_full_disk_keeps_the_checkpoint(
    tmp_path, monkeypatch
):
    """Through the strategy: a missing directory and a disk without room end the fit at set-up (no
    step taken, no scratch left); a disk that fills in the second epoch ends it with the message, the
    scratch removed, the epoch-1 checkpoint intact: resumed (on the host), it trains as one device."""
    disk = dict(offload="optimizer", offload_to="disk", offload_buffer="1MiB")

    def run(out: Path, directory: Path, epochs: int = 1, **kwargs) -> dict:
        torch.manual_seed(0)
        strategy = PipelineStrategy(pipeline_size=1, offload_dir=str(directory), **disk)
        return fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH), out, strategy=strategy, max_epochs=epochs,
                   **TRAIN, **kwargs)[0]  # fmt: skip

    with pytest.raises(ValueError, match=r"offload_dir '.*missing' does not exist: create it"):
        run(tmp_path / "a", tmp_path / "missing", max_steps=1)
    with monkeypatch.context() as m:
        m.setattr(scratch.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
        with pytest.raises(ValueError, match=r"needs .* bytes\) of disk .* has 1000 B \(1000 bytes\) free"):
            run(tmp_path / "b", tmp_path, max_steps=1)
    writes, write_from = [0], scratch.StateFile.write_from

    def filling(self, offset, buffer):
        writes[0] += 1
        if writes[0] > 2:  # (the epoch's two optimizer steps write one chunk each, then the disk is full)
            raise scratch.DiskFullError(errno.ENOSPC, f"the disk under offload_dir {self.directory!r} filled")
        write_from(self, offset, buffer)

    monkeypatch.setattr(scratch.StateFile, "write_from", filling)
    saved = tmp_path / "epoch1.ckpt"
    with pytest.raises(scratch.DiskFullError, match="filled"):
        run(tmp_path / "c", tmp_path, epochs=2, callbacks=[SaveAtEpochEnd(saved)])
    assert writes[0] == 3 and not (tmp_path / "rank0").exists(), "the scratch is removed on a failure"
    torch.manual_seed(0)
    strategy = PipelineStrategy(pipeline_size=1, offload="optimizer")
    resumed = fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH), tmp_path / "d", strategy=strategy, max_epochs=2,
                  ckpt_path=str(saved), **TRAIN)[0]  # fmt: skip
    torch.manual_seed(0)
    plain = PipelineStrategy(pipeline_size=1)
    two = fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH), tmp_path / "ref2", strategy=plain, max_epochs=2,
              **TRAIN)[0]  # fmt: skip
    assert_close_dicts(resumed["params"], two["params"], rtol=1e-5, atol=1e-6)


class FailsInSecondBatch(FrozenFirst):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("a bug in the user's step")
        return super().training_step(batch, batch_idx)


def test_a_checkpoint_saved_after_fit_holds_the_disk_tiers_state_an_interrupted_fit_none(tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` ends with the disk tier (its scratch already removed):
    the checkpoint's optimizer state is the run's without offload, and one device resumed from it trains
    as the uninterrupted run. A fit that fails removes the scratch too, without reading the state: its
    save is refused with the reason."""
    scratch_dir = tmp_path / "scratch"
    scratch_dir.mkdir()
    disk = dict(offload="optimizer", offload_to="disk", offload_dir=str(scratch_dir), offload_buffer="1MiB")
    saved = {}
    for name, options in (("none", {}), ("disk", disk)):
        torch.manual_seed(0)
        strategy = PipelineStrategy(pipeline_size=1, num_microbatches=4, **options)
        trainer = quiet_trainer(devices=1, strategy=strategy, default_root_dir=tmp_path / name, **TRAIN)
        trainer.fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH))
        assert not list(scratch_dir.iterdir()), "the scratch is removed when fit ends"
        saved[name] = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(saved[name])
    mine, theirs = (torch.load(saved[n], weights_only=False)["optimizer_states"][0] for n in ("disk", "none"))
    assert mine["param_groups"] == theirs["param_groups"]
    assert sorted(mine["state"]) == sorted(theirs["state"]) and len(theirs["state"]) == 8  # (not the frozen)
    for i, state in theirs["state"].items():
        assert sorted(mine["state"][i]) == sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        assert_close_dicts(mine["state"][i], state, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    resumed = fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH), tmp_path / "resumed", max_epochs=2,
                  strategy=PipelineStrategy(pipeline_size=1), ckpt_path=str(saved["disk"]),
                  **TRAIN)[0]  # fmt: skip
    torch.manual_seed(0)
    two = fit(FrozenFirst(), loader(DATA, GLOBAL_BATCH), tmp_path / "two", max_epochs=2,
              strategy=PipelineStrategy(pipeline_size=1), **TRAIN)[0]  # fmt: skip
    assert_close_dicts(resumed["params"], two["params"], rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    trainer = quiet_trainer(devices=1, strategy=PipelineStrategy(pipeline_size=1, **disk),
                            default_root_dir=tmp_path / "failed", **TRAIN)  # fmt: skip
    with pytest.raises(RuntimeError, match="a bug in the user's step"):
        trainer.fit(FailsInSecondBatch(), loader(DATA, GLOBAL_BATCH))
    assert not list(scratch_dir.iterdir()), "the scratch is removed when fit fails"
    with pytest.raises(RuntimeError, match=r"closed when its run was interrupted .* Resume from the last"):
        trainer.save_checkpoint(tmp_path / "failed.ckpt")
