"""Sequence parallelism in the planner (techniques/sequence_parallel/planned.py): each rank's activations
``/ k``, its compute at ``1/k`` of the tokens plus four all-to-alls per attention and pass, the state
sharded over ``dp x k`` by ZeRO-1 and FSDP2, and ``k`` in the search where the model's heads allow.
One process, a tiny GPT measured once (a second or two)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import TinyGPT, with_sdpa

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import given_links
from lightning_parallel.planner.ranking import Budget, fastest_fit, plan_search
from lightning_parallel.planner.search import Search
from lightning_parallel.planner.stage_costs import stage_costs
from lightning_parallel.planner.time_model import step_time
from lightning_parallel.planner.time_probe import TimeLine, UnitTime
from lightning_parallel.techniques.contract import SearchOptions
from lightning_parallel.techniques.ledgers import MemoryLedger, TimeLedger
from lightning_parallel.techniques.sequence_parallel import planned
from lightning_parallel.techniques.sequence_parallel.technique import TECHNIQUE

TOKENS = 64


def _gpt(kv_heads: int | None = None, tokens: int = TOKENS) -> TinyGPT:
    """A GPT of 4 SDPA blocks, 4 heads (``kv_heads``: its attentions' config declares them, as a Hugging
    Face attention's does)."""
    torch.manual_seed(0)
    model = with_sdpa(TinyGPT(vocab=13, dim=16, depth=4, heads=4, block_size=tokens))
    if kv_heads is not None:
        for block in model.h:
            block.attn.config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=kv_heads)
    return model


def _batch(samples: int = 4, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 13, (samples, tokens), generator=g), torch.randint(
        0, 13, (samples, tokens), generator=g
    )


@pytest.fixture(scope="module")
def facts():
    model = _gpt()
    return measure_model(model, _batch(), optimizer=torch.optim.AdamW(model.parameters()), time_sizes=(1, 4))


def test_the_attentions_and_the_sizes_that_split_their_heads_are_read_from_the_units(facts):
    assert planned.unit_attentions(facts.layout) == {f"h.{i}": [(4, 4)] for i in range(4)}
    assert planned.sizes(facts.layout) == [2, 4]
    assert facts.tokens == TOKENS
    model = _gpt(kv_heads=2)
    gqa = measure_model(model, _batch(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert planned.unit_attentions(gqa.layout)["h.0"] == [(4, 2)]
    assert planned.sizes(gqa.layout) == [2]  # (4 query heads, 2 key/value heads: k = 4 splits no kv head)


def test_each_rank_keeps_1_over_k_of_every_per_token_byte_and_its_state_whole(facts):
    plan = ParallelPlan("pipeline", 4, 2, num_microbatches=4, sequence_parallel_size=2)
    whole = stage_costs(facts, plan)
    mb = facts.samples / plan.num_microbatches
    plain = stage_costs(facts, ParallelPlan("pipeline", 4, 2, num_microbatches=4))
    for c, p in zip(whole, plain):  # the exchange buffers: a send and a receive copy of the query
        exchange = 2 * max(int(facts.probe.unit(n).outputs.at(mb)) for n in c.units if n.startswith("h."))
        assert (c.per_microbatch, c.kept_output) == (p.per_microbatch, p.kept_output)
        assert (
            c.forward_transient - p.forward_transient
            == c.backward_transient - p.backward_transient
            == exchange
        )
    ledger = MemoryLedger(plan, facts, 0, list(whole), device={"buffers": sum(c.recv_buffers for c in whole)})
    TECHNIQUE.memory(ledger)
    for c, w in zip(ledger.stages, whole):
        for f in ("per_microbatch", "kept_output", "forward_transient", "backward_transient", "recv_buffers"):
            assert getattr(c, f) == math.ceil(getattr(w, f) / 2), f
        assert (c.grads, c.weight_copies, c.param_keys) == (w.grads, w.weight_copies, w.param_keys)
    assert ledger.device["buffers"] == sum(c.recv_buffers for c in ledger.stages)
    assert not ledger.notes

    one, two, four = (
        predict(facts, ParallelPlan("pipeline", 4, 1, num_microbatches=2, sequence_parallel_size=k)).worst
        for k in (1, 2, 4)
    )
    for r in (two, four):
        assert (r.parameters, r.gradients, r.optimizer) == (one.parameters, one.gradients, one.optimizer)
    assert 0.5 < two.activations / one.activations < 0.55  # (half, and the exchange buffers' share)
    assert four.activations == pytest.approx(two.activations / 2, abs=4)


def test_zero1_and_fsdp2_shard_over_the_replicas_and_the_sequence_ranks(facts):
    def worst(**options):
        return predict(facts, ParallelPlan("pipeline", 4, 1, num_microbatches=2, **options)).worst

    for mode in ("zero1", "fsdp"):  # dp 2 x sp 2: four shards, as dp 4 has
        split, replicas = worst(data_parallel=mode, sequence_parallel_size=2), worst(data_parallel=mode)
        assert (split.parameters, split.optimizer) == (replicas.parameters, replicas.optimizer)
        assert split.optimizer < worst(sequence_parallel_size=2).optimizer


def test_compute_is_1_over_k_of_the_tokens_and_each_attention_exchanges_four_times_each_way(facts):
    links = given_links(bandwidth=1e9, latency=1e-5)
    plan = ParallelPlan("pipeline", 4, 1, num_microbatches=2, sequence_parallel_size=2)
    costs, mb, times = stage_costs(facts, plan), 2.0, facts.times
    units = costs[0].units
    ledger = TimeLedger(plan, facts, links, 0, costs, micro_batch=mb)
    ledger.forward[0] = sum(times.unit(n).forward.at(mb) for n in units)
    ledger.backward[0] = sum(times.unit(n).backward.at(mb) for n in units)
    TECHNIQUE.time(ledger)

    hidden = facts.probe.unit("h.0").outputs.at(mb) / 2  # one rank's tokens of a block's hidden states
    a2a = 4 * (1e-5 + hidden / 2 / 1e9)  # q, k, v and the output; each a ring step of (k - 1)/k of it
    assert a2a == pytest.approx(4 * links.all_to_all(2, hidden))
    assert ledger.forward[0] == pytest.approx(sum(times.unit(n).forward.at(1.0) for n in units) + 4 * a2a)
    assert ledger.backward[0] == pytest.approx(sum(times.unit(n).backward.at(1.0) for n in units) + 4 * a2a)
    assert ledger.shares[0]["communication"] == pytest.approx(8 * a2a)
    assert ledger.micro_batch == 1.0  # (the stage's send, a recomputed forward: one rank's tokens)

    recomputed = TimeLedger(
        replace_plan(plan, activation_checkpointing=True), facts, links, 0, costs, micro_batch=mb
    )
    recomputed.forward[0] = recomputed.backward[0] = 0.0
    TECHNIQUE.time(recomputed)
    assert recomputed.shares[0]["communication"] == pytest.approx(12 * a2a)  # (the forward's again)

    # With each unit's time proportional to its samples (the measured lines' slopes, no fixed cost: a
    # measured intercept moves with the machine's load), the compute at 1/k of the tokens is 1/k.
    proportional = dataclasses.replace(facts, times=dataclasses.replace(times, units={
        n: UnitTime(TimeLine(0.0, max(u.forward.slope, 1e-6)), TimeLine(0.0, max(u.backward.slope, 1e-6)))
        for n, u in times.units.items()
    }))  # fmt: skip
    one = step_time(proportional, links, ParallelPlan("pipeline", 4, 1, num_microbatches=2), 4)
    two = step_time(proportional, links, plan, 4)
    # The gradients are all-reduced over 4 ranks either way (dp 4, or dp 2 x sp 2): what differs in the
    # communication is the all-to-alls: 2 micro-batches x 4 blocks x (4 in forward + 4 in backward).
    assert two.communication - one.communication == pytest.approx(2 * 4 * 2 * a2a)
    assert two.schedule - 2 * 4 * 2 * a2a < one.schedule


def replace_plan(plan: ParallelPlan, **changes) -> ParallelPlan:
    from dataclasses import replace

    return replace(plan, **changes)


def test_the_search_tries_k_where_the_heads_allow_and_the_sequence_is_long_or_it_is_asked(facts):
    plan = ParallelPlan("pipeline", 4, 1, num_microbatches=2)
    asked = SearchOptions(model=facts, sequence_parallel=True)

    def sizes(plan, options):  # (each k with the plan's micro-batches, and with k times as many)
        found = list(TECHNIQUE.variants(plan, options))
        assert found[0] == {} and found[1::2] == [{"sequence_parallel_size": o["sequence_parallel_size"]}
                                                  for o in found[2::2]]  # fmt: skip
        assert all(o["num_microbatches"] == 2 * o["sequence_parallel_size"] for o in found[2::2])
        return [o["sequence_parallel_size"] for o in found[1::2]]

    assert sizes(plan, asked) == [2, 4]
    assert sizes(replace_plan(plan, pipeline_size=2), asked) == [2]  # (4 devices: pp 2 x sp 2)
    assert list(TECHNIQUE.variants(plan, SearchOptions(model=facts))) == [{}]  # (64 tokens: short)
    assert list(TECHNIQUE.variants(plan, SearchOptions(sequence_parallel=True))) == [{}]  # (no model)
    long = SimpleNamespace(layout=facts.layout, tokens=planned.LONG_SEQUENCE)
    assert sizes(plan, SearchOptions(model=long)) == [2, 4]
    odd = SimpleNamespace(layout=facts.layout, tokens=planned.LONG_SEQUENCE + 2)  # (4 does not divide it)
    assert sizes(plan, SearchOptions(model=odd)) == [2]
    assert list(TECHNIQUE.variants(plan, SearchOptions(model=long, sequence_parallel=False))) == [{}]
    gpt = TinyGPT(vocab=13, dim=16, heads=4)
    eager = measure_model(gpt, _batch(tokens=8), optimizer=torch.optim.SGD(gpt.parameters(), lr=0.1))
    assert planned.unit_attentions(eager.layout)["h.0"] == [(4, 4)]  # (sized when asked: see the heads)
    assert sizes(plan, SearchOptions(model=eager, sequence_parallel=True)) == []  # (softmax(q k^T): no SDPA)
    unknown = torch.nn.Sequential(torch.nn.Linear(2, 2))
    none = SimpleNamespace(
        layout=SimpleNamespace(units=[SimpleNamespace(name="0", module=unknown)]), tokens=4096
    )
    assert list(TECHNIQUE.variants(plan, SearchOptions(model=none))) == [{}]


def test_the_search_proposes_k_2_where_it_fits_and_no_plan_of_whole_sequences_does():
    """Two devices, two samples of a long sequence per step and 4 query / 2 key-value heads: the replicas
    hold a sample each, a pipeline two half-depth micro-batches; splitting the sequence holds half a sample
    (k = 2 only: 4 does not split the key/value heads)."""
    model = _gpt(kv_heads=2, tokens=512)
    facts = measure_model(model, _batch(2, tokens=512), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    search = Search(devices=2, global_batch_size=2, offload=False, sequence_parallel=True)
    candidates = plan_search({1: facts}, search)
    split = [c for c in candidates if c.plan.sequence_parallel_size > 1]
    assert {c.plan.sequence_parallel_size for c in split} == {2}
    assert {c.plan.num_microbatches for c in split} == {1, 2}  # (one replica of 2 samples: 1 or 2 of 1)
    whole = [c for c in candidates if c.plan.sequence_parallel_size == 1]
    budget = Budget(min(c.peak for c in whole) - 1, margin=0.0)
    chosen = fastest_fit(candidates, budget)
    assert chosen is not None and chosen.plan.sequence_parallel_size == 2, [
        (c.plan.label(), c.peak) for c in candidates
    ]
    assert chosen.plan.code().count("sequence_parallel_size=2") == 1
    without = plan_search({1: facts}, Search(devices=2, global_batch_size=2, offload=False))
    assert all(c.plan.sequence_parallel_size == 1 for c in without)  # (512 tokens: not tried unasked)
    assert len(without) == len(whole)


def test_a_hugging_face_llama_s_heads_come_from_its_config_and_an_eager_one_is_not_searched():
    import hf_env

    tf = hf_env.require("transformers")
    from hf_models import hf_config

    from lightning_parallel.planner.hf import CausalLMStep

    ids = torch.randint(0, 64, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    found, measured = {}, {}
    for attention in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = CausalLMStep(
            tf.AutoModelForCausalLM.from_config(hf_config("llama"), attn_implementation=attention)
        )
        facts = measure_model(model, (ids, ids))
        assert planned.unit_attentions(facts.layout) == {
            f"model.model.layers.{i}": [(4, 2)] for i in range(4)
        }
        found[attention], measured[attention] = planned.sizes(facts.layout), facts
    assert found == {"sdpa": [2], "eager": []}  # (an eager attention is not split: the job would refuse it)
    search = Search(devices=2, global_batch_size=2, offload=False, sequence_parallel=True)
    tried = {
        a: {c.plan.sequence_parallel_size for c in plan_search({1: f}, search)} for a, f in measured.items()
    }
    assert tried == {"sdpa": {1, 2}, "eager": {1}}
