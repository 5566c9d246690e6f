"""sources/fake_device.py: a module's tensors as fake tensors of the device its stages run on."""

import pytest
import torch
from tiny_models import DeviceAwareGPT, TinyGPT
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_parallel.sources.fake_device import faked_on, trace_device, tracks_gradients
from lightning_parallel.sources.twin import meta_twin, to_meta


def _tensors(module):
    return [*module.parameters(), *module.buffers()]


def test_trace_device_gives_accelerators_an_index():
    assert trace_device(None) == torch.device("cpu") and trace_device("cpu") == torch.device("cpu")
    assert trace_device("cuda:1") == torch.device("cuda", 1)
    if not torch.cuda.is_available():
        assert trace_device("cuda") == torch.device("cuda", 0)


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_faked_module_reports_the_device_keeps_its_ties_and_gets_its_tensors_back(device):
    twin = meta_twin(TinyGPT(depth=2))
    before = {n: t for n, t in twin.named_parameters(remove_duplicate=False)}
    with faked_on(twin, device) as fake:
        tensors = _tensors(twin)
        assert all(isinstance(t, FakeTensor) and t.device == torch.device(device) for t in tensors)
        assert isinstance(twin.wte.weight, nn.Parameter) and twin.lm_head.weight is twin.wte.weight
        assert fake.original(twin.h[0].attn.qkv.weight) is before["h.0.attn.qkv.weight"]
        # autograd records on fake tensors only where this process has the device's runtime
        assert twin.wte.weight.requires_grad == tracks_gradients(torch.device(device))
        [idx] = fake.inputs(to_meta((torch.zeros(2, 8, dtype=torch.long),)))
        assert isinstance(idx, FakeTensor) and idx.device == torch.device(device) and idx.dtype == torch.long
    assert {n: t for n, t in twin.named_parameters(remove_duplicate=False)} == before
    assert all(t.is_meta for t in _tensors(twin))


def test_a_forward_asking_its_device_runs_on_fake_cuda_tensors_without_a_gpu():
    twin = meta_twin(DeviceAwareGPT(depth=1))
    with faked_on(twin, "cuda:0") as fake, torch.no_grad():
        [idx] = fake.inputs((torch.zeros(2, 5, dtype=torch.long),))
        with fake.mode:
            logits = twin(idx)
    assert logits.device == torch.device("cuda", 0) and logits.shape == (2, 5, 13)


def test_tensor_attributes_a_forward_rebinds_are_put_back():
    class Rebinds(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.ones(3)  # a plain attribute, not a buffer (as Meta's llama keeps freqs_cis)
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            self.scale = self.scale.to(x.device) * 1.0  # (a new tensor: a fake one while faked)
            return self.lin(x) * self.scale

    module = Rebinds()
    scale = module.scale
    with faked_on(module, "cpu") as fake:
        [x] = fake.inputs((torch.zeros(2, 3),))
        with fake.mode:
            module(x)
        assert isinstance(module.scale, FakeTensor)
    assert module.scale is scale and not isinstance(module.lin.weight, FakeTensor)
