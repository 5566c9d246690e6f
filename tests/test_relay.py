"""Values that skip stages are relayed through the stages between (sources/traced/relay.py).

SkipGPT hands its padding mask (a root input, first read by h.2) and its embeddings x0 (read by every
block) past the next stage, as litgpt and the Hugging Face decoders do with their masks and rotary
tables. torch's traced stages run such a pipe only once every stage reads its neighbour alone.
"""

import itertools
import operator

import pytest
import torch
from tiny_models import SkipGPT, TinyGPT, masked_token_data
from torch.distributed.pipelining import SplitPoint, pipeline

from lightning_parallel.sources.traced.relay import relay_skips
from lightning_parallel.sources.traced.trace import trace

SPLITS = {
    "4 stages, mask first read by stage 2": ["h.1", "h.2", "h.3"],
    "2 stages, mask read by both": ["h.2"],
    "3 stages": ["h.1", "h.3"],
}


def _example():
    idx, keep, _ = masked_token_data(4).tensors
    return idx, keep


def _stages(pipe):
    return [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]


def _source(value):
    return value.args[0] if value.target is operator.getitem else value


def _index(value):
    return value.args[1] if value.target is operator.getitem else 0


def _assert_each_stage_reads_only_its_neighbour_in_the_order_it_sends(pipe) -> None:
    stages = _stages(pipe)
    roots = [n for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    assert list(stages[0].args) == roots  # the schedule calls stage 0 with every input of forward
    for previous, stage in itertools.pairwise(stages):
        assert all(_source(a) is previous for a in stage.args), (stage.name, stage.args)
        assert [_index(a) for a in stage.args] == sorted(_index(a) for a in stage.args)
        sent = [_index(u) for u in previous.users]  # torch numbers a stage's outputs by its users' order
        assert sent == list(range(len(sent)))


# One trace per split: the structure (every stage reads its neighbour alone, in the order it sends) and
# the values (forward and gradients as the model's own) of the same relayed pipe.
@pytest.mark.parametrize("mask_from", [0, 2])
@pytest.mark.parametrize("split", list(SPLITS))
def test_the_relayed_stages_read_only_their_neighbour_and_compute_forward_and_its_gradients(split, mask_from):
    torch.manual_seed(0)
    model = SkipGPT(mask_from=mask_from)
    # Untied: torch's pipe copies a tied weight into each stage that reads it (the strategy's
    # shared-weight replicas handle that); untied, the stages hold the model's own parameters.
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    example = _example()
    expected = model(*example)
    expected.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    pipe = trace(model, example, SPLITS[split], train=True)
    _assert_each_stage_reads_only_its_neighbour_in_the_order_it_sends(pipe)
    values = example
    for k in range(pipe.num_stages):
        out = pipe.get_stage_module(k)(*values)
        values = out if isinstance(out, tuple) else (out,)
    (logits,) = values
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    logits.square().mean().backward()
    assert pipe.num_stages == len(SPLITS[split]) + 1
    for name, p in model.named_parameters():  # the traced stages hold the model's own parameters
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_model_whose_stages_read_only_their_neighbours_is_left_as_traced():
    model = TinyGPT()
    idx = torch.zeros(2, 8, dtype=torch.long)
    pipe = pipeline(model, (idx,), split_spec={"h.1": SplitPoint.BEGINNING, "h.3": SplitPoint.BEGINNING})
    before = [(s.name, s.args) for s in _stages(pipe)]
    assert relay_skips(pipe) == 0
    assert [(s.name, s.args) for s in _stages(pipe)] == before


def test_relays_are_counted_once_per_value_and_stage():
    pipe = pipeline(
        SkipGPT(mask_from=2), _example(),
        split_spec={p: SplitPoint.BEGINNING for p in ["h.1", "h.2", "h.3"]},
    )  # fmt: skip
    # keep (a root input read by stages 2 and 3) passes stages 0, 1 and 2; x0 (made by stage 0) 1 and 2.
    assert relay_skips(pipe) == 5
    assert relay_skips(pipe) == 0  # relaying again finds nothing left to relay
