"""The harness itself: N processes under Lightning's DDP (gloo, spawn) match one process."""

import pytest
import torch
from mp_harness import assert_close_dicts, ddp_spawn, fit, reference_loader
from tiny_models import SequentialRegressor, loader, regression_data


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
