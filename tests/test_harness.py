"""The harness itself: N processes under Lightning's DDP (gloo, spawn) match one process; the ranks, ports
and child processes that the tests and the experiments share (lightning_parallel/_testing.py)."""

import socket
import sys

import pytest
import torch
from mp_harness import assert_close_dicts, ddp_spawn, fit, reference_loader
from tiny_models import SequentialRegressor, loader, regression_data

from lightning_parallel import _testing as testing


def _reference(tmp_path, batch_size: int):
    torch.manual_seed(0)
    model = SequentialRegressor()
    return fit(model, reference_loader(regression_data(), batch_size), tmp_path / "ref", devices=1)[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("devices", [2, 4])
def test_ddp_spawn_matches_single_process(tmp_path, devices):
    ref = _reference(tmp_path, batch_size=16)
    torch.manual_seed(0)
    model = SequentialRegressor()
    records = fit(model, loader(regression_data(), 16 // devices), tmp_path / "ddp", devices, ddp_spawn())
    assert [r["rank"] for r in records] == list(range(devices))
    for record in records:
        assert_close_dicts(record["params"], ref["params"])
    # The spawn launcher also brings rank 0's weights back into the user's object.
    assert_close_dicts(dict(model.state_dict()), ref["params"])


def test_assert_close_dicts_catches_a_difference():
    a = {"w": torch.zeros(3)}
    with pytest.raises(AssertionError, match="w"):
        assert_close_dicts(a, {"w": torch.tensor([0.0, 0.0, 1e-3])})
    with pytest.raises(AssertionError, match="missing"):
        assert_close_dicts(a, {"w": torch.zeros(3), "b": torch.zeros(1)})


def _collectives_and_fit(rank: int, world: int, scale: float) -> dict:
    """Runs on each spawned rank: a plain all_reduce, then a 2-process Lightning fit (DDP)."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    draw = float(torch.rand(()))  # the caller's random state, in every rank
    t = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(t)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model = Tiny()
    trainer = testing.quiet_trainer(devices=world, strategy="ddp", max_steps=3)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {
        "rank": rank,
        "sum": float(t),
        "weight": model.net.weight.detach().clone(),
        "steps": trainer.global_step,
        "draw": draw,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_spawn_brings_back_every_rank_of_collectives_and_a_fit():
    torch.manual_seed(7)
    draw = float(torch.rand(()))
    torch.manual_seed(7)
    results = testing.spawn(_collectives_and_fit, 2, 1.5)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["draw"] for r in results] == [draw, draw]
    assert [r["sum"] for r in results] == [4.5, 4.5]
    assert [r["steps"] for r in results] == [3, 3]
    # DDP kept the replicas identical: the Trainer joined the harness's process group.
    assert results[0]["weight"].equal(results[1]["weight"])


def _fails_on_rank_one(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one's own error")
    dist.barrier()  # rank 0 waits here: its collective breaks when rank 1 is gone
    return rank


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_spawn_raises_the_traceback_of_the_rank_that_failed_not_of_a_bystander():
    with pytest.raises(testing.ChildFailed) as raised:
        testing.spawn(_fails_on_rank_one, 2)
    message = str(raised.value)
    first = message.index("--- rank 1 of 2 raised in _fails_on_rank_one ---\nTraceback")
    assert message.index("ValueError: rank one's own error") > first
    assert "rank 0 of 2" not in message[:first]  # (rank 0's broken barrier, if it got to raise, comes after)


def test_run_child_raises_with_the_end_of_the_child_s_stderr_and_stdout():
    code = "import sys; print('what it printed'); sys.exit('the reason it gave')"
    with pytest.raises(testing.ChildFailed) as raised:
        testing.run_child([sys.executable, "-c", code])
    message = str(raised.value)
    assert "exit code 1" in message and "the reason it gave" in message and "what it printed" in message
    assert testing.run_child([sys.executable, "-c", "print('fine')"]) == "fine\n"


def test_ports_come_from_standalone_port_upward_else_from_this_worker_s_slice(monkeypatch):
    monkeypatch.delenv("STANDALONE_PORT", raising=False)
    base = testing.free_port()
    assert base in testing.PORTS and testing.free_port() != base  # a new one at each call
    monkeypatch.setenv("STANDALONE_PORT", str(base))
    with socket.socket() as taken:  # the first port is in use: both picks lie past it, each its own
        taken.bind(("127.0.0.1", base))
        taken.listen()
        first, second = testing.free_port(), testing.free_port()
    assert base < first < second < base + 100
    # Two pytest-xdist workers draw from two slices that do not meet.
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(testing._worker_ports()))
    assert slices[0] and slices[1] and not slices[0] & slices[1]
