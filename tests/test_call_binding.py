"""sources/traced/call_binding.py: one call of the pipelined module as tensors in, tensors out (pure logic).

The Hugging Face runs of tests/test_pipeline_hf.py go through it under PipelineStrategy; here its pieces
run alone on tiny modules.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_parallel.sources.traced.call_binding import CallBinding, TracedCall, bound_forward


def test_a_calls_tensors_become_the_inputs_in_order_and_the_rest_constants():
    x, mask = torch.ones(2, 3), torch.zeros(2, 3)
    binding, tensors = CallBinding.of("model", (x,), {"attention_mask": mask, "use_cache": False})
    assert len(tensors) == 2 and tensors[0] is x and tensors[1] is mask
    assert binding.constants == (None, None, False)
    args, kwargs = binding.arguments((x + 1, mask + 1))
    assert torch.equal(args[0], x + 1) and torch.equal(kwargs["attention_mask"], mask + 1)
    assert kwargs["use_cache"] is False
    # The trace specialises on the structure and the constants, not on the tensors' values.
    same, _ = CallBinding.of("model", (torch.randn(4, 5),), {"attention_mask": mask, "use_cache": False})
    other, _ = CallBinding.of("model", (x,), {"attention_mask": mask, "use_cache": True})
    assert binding.same_call(same) and not binding.same_call(other)
    assert not binding.same_call(CallBinding.of("model", (x, mask), {"use_cache": False})[0])


def test_an_output_is_flattened_to_its_tensors_and_rebuilt_for_the_step():
    binding, _ = CallBinding.of("", (torch.ones(1),), {})
    logits, loss = torch.ones(2, 4), torch.tensor(0.5)
    flat = binding.flat_output({"logits": logits, "extra": (loss,)})
    assert isinstance(flat, tuple) and flat[0] is logits and flat[1] is loss
    rebuilt = binding.output(flat)
    assert rebuilt["logits"] is logits and rebuilt["extra"] == (loss,)
    assert binding.flat_output(logits) is logits and binding.output(logits) is logits  # a tensor as is


def test_an_output_with_non_tensor_values_is_refused_with_the_fix():
    binding, _ = CallBinding.of("model", (torch.ones(1),), {})
    with pytest.raises(
        TypeError, match=r"`model` returns non-tensor values \(int\) beside its tensors.*use_cache"
    ):
        binding.flat_output((torch.ones(1), 3))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.config = SimpleNamespace(use_cache=True)
        self.seen_use_cache = None

    def forward(self, x, scale=1.0):
        self.seen_use_cache = self.config.use_cache
        return {"y": self.inner(x) * scale}


def test_bound_forward_runs_the_call_on_the_tensors_and_is_undone():
    module, x = Scaled(), torch.randn(2, 3)
    binding, tensors = CallBinding.of("", (x,), {"scale": 2.0})
    with bound_forward(module, binding):
        (y,) = module(*tensors)
        assert module.seen_use_cache is False  # no key/value cache inside a pipeline
    torch.testing.assert_close(y, module.inner(x) * 2.0)
    assert "forward" not in vars(module) and module.config.use_cache is True
    inner, _ = CallBinding.of("inner", (x,), {})
    with bound_forward(module, inner):
        torch.testing.assert_close(module(x), module.inner(x))  # the call goes to the submodule


def test_traced_call_captures_keywords_and_refuses_a_step_that_calls_otherwise():
    module, x = Scaled(), torch.randn(2, 3)
    call = TracedCall("`self.model(...)`")
    holder = nn.Module()
    holder.model = module
    call.install(holder, "model")

    def step(scale):
        return holder.model(x, scale=scale)["y"].sum()

    assert call.capture(step, 2.0) == (x,)
    binding = call.bindings[True]
    binding.flat_output({"y": torch.zeros(2, 3)})  # the structure, known once traced
    with call.replaying(torch.ones(2, 3)):
        assert step(2.0) == 6.0  # the replayed output, rebuilt as the dict the module returns
    with pytest.raises(
        ValueError,
        match=r"called with other arguments than at the first training step "
        r"\(`model\(<tensor>, scale=3\.0\)` instead of `model\(<tensor>, scale=2\.0\)`\)",
    ):
        call.capture(step, 3.0)
    call.train = False
    assert call.capture(step, 3.0) == (x,)  # evaluation has its own binding
    TracedCall.uninstall(holder, "model")
    assert "forward" not in vars(module)
