"""proxy.py: the stand-in that captures the pipelined call's input and replays its output (pure logic)."""

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.proxy import PipelinedCall
from lightning_parallel.sources.sequential.call import PipelinedSequential


def test_sequential_stand_in_keeps_the_unsplit_keys_and_captures_then_replays_once():
    proxy = PipelinedSequential({"3": nn.Linear(2, 2)}, name="layers")
    assert list(proxy.state_dict()) == ["3.weight", "3.bias"]
    x = torch.ones(4, 2)
    assert proxy.call.capture(lambda inp: proxy(inp) + 1, x)[0] is x
    with proxy.call.replaying("out"):
        assert proxy(x) == "out"
        with pytest.raises(RuntimeError, match="called twice in one step"):
            proxy(x)
    with pytest.raises(RuntimeError, match=r"holds only this rank's pipeline stage \(layers \['3'\]\)"):
        proxy(x)
    with pytest.raises(
        RuntimeError, match=r"returned without calling the pipelined Sequential `self\.layers`"
    ):
        proxy.call.capture(lambda inp: inp, x)


def test_forward_stand_in_goes_in_place_of_a_modules_forward():
    module = nn.Linear(2, 2)
    call = PipelinedCall("`self(...)` (Linear.forward)", "stages h.0-1")
    module.forward = call
    x = torch.ones(3, 2)
    assert call.capture(lambda inp: module(inp), x) == (x,)
    with call.replaying(torch.zeros(3, 2)):
        assert torch.equal(module(x), torch.zeros(3, 2))
    with pytest.raises(TypeError, match="takes positional inputs only"):
        module(x, scale=2)
    with pytest.raises(RuntimeError, match=r"holds only this rank's pipeline stage \(stages h.0-1\)"):
        module(x)


def test_a_broad_except_in_user_code_does_not_swallow_the_capture():
    call = PipelinedCall("the call")

    def step(inp):
        try:
            return call(inp)
        except Exception:
            return None

    assert call.capture(step, 5) == (5,)
