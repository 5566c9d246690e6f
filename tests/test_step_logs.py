"""step_logs.py: what a step logs per micro-batch, combined like one call over the batch (pure logic)."""

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.step_logs import LogRecorder, from_record, to_record


def test_logged_values_combine_over_micro_batches_like_one_call_over_the_batch():
    module = nn.Module()
    recorder = LogRecorder()
    for value, samples in ((1.0, 3), (4.0, 1)):
        with recorder.recording(module, samples):
            module.log("loss", torch.tensor(value), prog_bar=True)
            module.log("most", value, reduce_fx="max")
            module.log("tokens", value, reduce_fx="sum", batch_size=2)
    loss, most, tokens = recorder.entries()
    assert loss.combined() == pytest.approx((1 * 3 + 4 * 1) / 4) and loss.replay_kwargs()["batch_size"] == 4
    assert most.combined() == 4.0 and tokens.combined() == 5.0 and tokens.replay_kwargs()["batch_size"] == 4
    assert not hasattr(module, "log")  # the recorder's stand-in is gone
    with recorder.recording(module, 1), pytest.raises(TypeError, match="a number or a torchmetrics Metric"):
        module.log("metric", object())
    with recorder.recording(module, 1), pytest.raises(ValueError, match=r"shape \(2,\): log scalars"):
        module.log("vector", torch.ones(2))


def test_a_record_of_logs_rebuilds_every_log_call_with_its_options():
    module = nn.Module()
    recorder = LogRecorder()
    for value, samples in ((1.0, 3), (4.0, 1)):
        with recorder.recording(module, samples):
            module.log("loss", torch.tensor(value), prog_bar=True)
            module.log("most", value, reduce_fx="max")
    layout, values = to_record(recorder.entries(), 0.5)
    leading, logs = from_record(layout, values, leading=1)
    assert leading == [0.5]
    assert logs == [
        ("loss", 1.75, {"prog_bar": True, "batch_size": 4}),
        ("most", 4.0, {"reduce_fx": "max", "batch_size": 4}),
    ]
    assert to_record(recorder.entries(), 0.9)[0] == layout  # the next step's layout is the same
