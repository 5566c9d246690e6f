"""The planner's numbers pinned: every RankMemory and StepTime field of plans covering every technique.

The memory estimate and the time model fold the techniques' ``memory``/``time`` members (issue 51); these
pins were recorded by the code that named each technique inline, before that move, and hold the fold to
the same numbers (bytes exactly, seconds within 1e-12). The facts are measured on small models (bytes
are deterministic on one torch build); the unit times, the optimizer steps and the links are synthetic,
so the seconds do not depend on the machine. The plans cover plain replicas, ZeRO-1, FSDP2, HSDP, tensor
parallelism, recomputation, compile, each offload and their combinations, on 1F1B, GPipe, interleaved
and a split-backward schedule, with and without accumulation.

A deliberate change of the model (the probe, a formula) records again:
``PYTHONPATH=$PWD .venv/bin/python tests/test_planner_fold.py --record``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from tiny_models import SequentialRegressor, TinyGPT
from tiny_tp_models import SplitQkvGPT

from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner import estimate, time_model
from lightning_parallel.planner.estimate import predict
from lightning_parallel.planner.facts import ModelFacts, measure_model
from lightning_parallel.planner.links import Link, Links
from lightning_parallel.planner.probe import BEFORE
from lightning_parallel.planner.time_model import step_time
from lightning_parallel.planner.time_probe import AFTER, StepCost, TimeFacts, TimeLine, UnitTime
from lightning_parallel.techniques import TECHNIQUES
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.fsdp.timing import FsdpTimes
from lightning_parallel.techniques.ledgers import Line, MemoryLedger, TimeLedger
from lightning_parallel.techniques.tensor_parallel.technique import BlockTimes, TensorParallelTimes

PINS = Path(__file__).with_name("planner_fold_pins.json")
LINKS = Links(Link(2e-5, 3e9), Link(1.5e-5, 1.7e9), Link(3e-6, 2.3e8))
P = ParallelPlan


def _times(facts: ModelFacts) -> TimeFacts:
    """Unit times that differ by unit (and an ``<after>`` share for some), an optimizer step per element
    and per tensor, slower on the host: every term of the time model has a value of its own."""
    names = [BEFORE, *(u.name for u in facts.layout.units)]
    units = {}
    for i, name in enumerate(names):
        forward = TimeLine(1e-4 * (1 + i / 7), 3e-5 * (1 + i / 3))
        units[name] = UnitTime(forward, TimeLine(2e-4 / (1 + i), 7e-5))
        if i % 2:
            units[name + AFTER] = UnitTime(TimeLine(1e-5, 1e-6 * i), TimeLine(2e-5, 3e-6))
    return TimeFacts(units, (2, 8), StepCost(3e-9, 2e-6), StepCost(1.1e-8, 5e-6))


@cache
def _facts(name: str) -> ModelFacts:
    torch.manual_seed(0)
    if name == "mlp":  # a split Sequential: 5 blocks and a head, AdamW
        model, batch, kwargs = SequentialRegressor(d_in=16, hidden=64, depth=6, adam=True), _regression(), {}
    elif name == "mlp16":  # the same under 16-mixed: the GradScaler's state on every rank
        model, batch, kwargs = (
            SequentialRegressor(d_in=16, hidden=64, depth=6, adam=True),
            _regression(),
            {"precision": "16-mixed"},
        )
    elif name == "gpt":  # blocks in a ModuleList, a head tied to the embedding
        model, batch, kwargs = TinyGPT(depth=4), _tokens(13), {}
    else:  # "tp": one of two tensor-parallel ranks' local model (row-wise splits: all-reduces)
        model, batch, kwargs = SplitQkvGPT(depth=3), _tokens(13), {"tensor_parallel_size": 2}
    facts = measure_model(model, batch, **kwargs)
    return dataclasses.replace(facts, times=_times(facts))


def _regression():
    return torch.randn(16, 16), torch.randn(16, 4)


def _tokens(vocab: int):
    x = torch.randint(0, vocab, (16, 9))
    return x[:, :-1], x[:, 1:]


# (name, facts, plan, samples per replica, batches per optimizer step); the step time only for pipelines
# fmt: off
CASES = [
    ("pp2 1f1b", "mlp", P("pipeline", 2, 2, 4), 16, 1),
    ("pp2 gpipe", "mlp", P("pipeline", 2, 2, 4, "gpipe"), 16, 1),
    ("pp4 1f1b m8", "mlp", P("pipeline", 4, 4, 8), 16, 1),
    ("pp2x2 interleaved", "mlp", P("pipeline", 4, 2, 4, "interleaved_1f1b", 2), 16, 1),
    ("pp2 zbv", "mlp", P("pipeline", 2, 2, 4, "zbv", 2), 16, 1),
    ("pp2x2 replicate", "mlp", P("pipeline", 4, 2, 4), 8, 1),
    ("pp1x4 replicate", "mlp", P("pipeline", 4, 1, 2), 8, 1),
    ("pp2x2 accumulate", "mlp", P("pipeline", 4, 2, 4, accumulate_grad_batches=2), 8, 2),
    ("pp2x2 zero1", "mlp", P("pipeline", 4, 2, 4, data_parallel="zero1"), 8, 1),
    ("pp2x2 fsdp", "mlp", P("pipeline", 4, 2, 4, data_parallel="fsdp"), 8, 1),
    ("pp1x4 fsdp", "mlp", P("pipeline", 4, 1, 2, data_parallel="fsdp"), 8, 1),
    ("pp2x4 hsdp", "mlp", P("pipeline", 8, 2, 4, data_parallel="fsdp", data_parallel_shard_size=2), 8, 1),
    ("pp2 recompute", "mlp", P("pipeline", 2, 2, 4, activation_checkpointing=True), 16, 1),
    ("pp2 recompute some", "mlp", P("pipeline", 2, 2, 4, activation_checkpointing=["layers.1", "layers.3"]),
     16, 1),
    ("pp2 compile", "mlp", P("pipeline", 2, 2, 4, compile=True), 16, 1),
    ("pp2 offload opt", "mlp", P("pipeline", 2, 2, 4, offload="optimizer"), 16, 1),
    ("pp2x2 zero1 offload opt", "mlp", P("pipeline", 4, 2, 4, data_parallel="zero1", offload="optimizer"),
     8, 1),
    ("pp2x2 fsdp offload param", "mlp", P("pipeline", 4, 2, 4, data_parallel="fsdp", offload="parameters"),
     8, 1),
    ("pp2x4 hsdp offload param", "mlp",
     P("pipeline", 8, 2, 4, data_parallel="fsdp", data_parallel_shard_size=2, offload="parameters"), 8, 1),
    ("pp2 offload act", "mlp", P("pipeline", 2, 2, 4, offload="activations"), 16, 1),
    ("pp2x2 interleaved offload act+opt", "mlp",
     P("pipeline", 4, 2, 4, "interleaved_1f1b", 2, offload=["activations", "optimizer"]), 8, 2),
    ("pp2 recompute offload act", "mlp",
     P("pipeline", 2, 2, 4, activation_checkpointing=True, offload="activations"), 16, 1),
    ("pp2x2 fsdp recompute offload all", "mlp",
     P("pipeline", 4, 2, 4, data_parallel="fsdp", activation_checkpointing=["layers.2"],
       offload=["parameters", "activations"], accumulate_grad_batches=2), 8, 2),
    ("pp2x2 zero1 compile recompute", "mlp",
     P("pipeline", 4, 2, 4, data_parallel="zero1", compile=True, activation_checkpointing=True), 8, 1),
    ("16 pp2x2 zero1", "mlp16", P("pipeline", 4, 2, 4, data_parallel="zero1", precision="16-mixed"), 8, 1),
    ("16 pp2x2 fsdp offload param", "mlp16",
     P("pipeline", 4, 2, 4, data_parallel="fsdp", offload="parameters", precision="16-mixed"), 8, 1),
    ("16 pp2x2 zero1 offload opt", "mlp16",
     P("pipeline", 4, 2, 4, data_parallel="zero1", offload="optimizer", precision="16-mixed"), 8, 1),
    ("gpt pp2", "gpt", P("pipeline", 2, 2, 4), 16, 1),
    ("gpt pp2x2 zero1 recompute", "gpt", P("pipeline", 4, 2, 4, data_parallel="zero1",
                                           activation_checkpointing=True), 8, 1),
    ("gpt pp2x2 interleaved offload opt", "gpt", P("pipeline", 4, 2, 4, "interleaved_1f1b", 2,
                                                   offload="optimizer"), 8, 1),
    ("tp pp2 tp2", "tp", P("pipeline", 4, 2, 4, tensor_parallel_size=2), 16, 1),
    ("tp pp1x2 tp2", "tp", P("pipeline", 4, 1, 2, tensor_parallel_size=2), 8, 1),
    ("tp pp2x2 tp2 fsdp", "tp", P("pipeline", 8, 2, 4, tensor_parallel_size=2, data_parallel="fsdp"), 8, 1),
    ("tp pp2 tp2 recompute", "tp", P("pipeline", 4, 2, 4, tensor_parallel_size=2,
                                     activation_checkpointing=True), 16, 1),
    ("ddp", "mlp", P("ddp", 2), 8, 1),
    ("single device", "mlp", P("single_device", 1), 16, 1),
]
# fmt: on


def _numbers(facts_name: str, plan: ParallelPlan, samples: int, accumulate: int) -> dict:
    facts = _facts(facts_name)
    estimate = predict(facts, plan, samples=samples)
    out: dict = {"ranks": [dataclasses.asdict(r) for r in estimate.ranks], "table": estimate.format_table()}
    if plan.strategy == "pipeline":
        out["time"] = dataclasses.asdict(step_time(facts, LINKS, plan, samples, accumulate))
    return json.loads(json.dumps(out))  # (tuples as lists, as the pins hold them)


def _close(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def pins() -> dict:
    return json.loads(PINS.read_text())


def test_the_cases_cover_every_technique():
    plans = [plan for _, _, plan, _, _ in CASES]
    assert {p.data_parallel for p in plans} == {"replicate", "zero1", "fsdp"}
    assert any(p.shard_size < p.data_parallel_size for p in plans)  # HSDP
    assert {t for p in plans for t in p.offload} == {"optimizer", "parameters", "activations"}
    assert any(p.tensor_parallel_size > 1 for p in plans) and any(p.compiled for p in plans)
    assert any(p.activation_checkpointing is True for p in plans)
    assert any(isinstance(p.activation_checkpointing, tuple) for p in plans)
    assert {"1f1b", "gpipe", "interleaved_1f1b", "zbv"} <= {p.schedule for p in plans}


@pytest.mark.parametrize(("name", "facts", "plan", "samples", "accumulate"), CASES, ids=[c[0] for c in CASES])
def test_the_planner_s_numbers_are_the_pinned_ones(pins, name, facts, plan, samples, accumulate):
    _close(_numbers(facts, plan, samples, accumulate), pins[name], name)


class _Disk(Technique):
    """A stand-in for a technique the planner has never seen: the optimizer state on disk, read back and
    written out around each optimizer step."""

    def memory(self, ledger: MemoryLedger) -> None:
        state = ledger.device["optimizer"]
        ledger.device["optimizer"] -= state
        ledger.disk["optimizer"] = state

    def time(self, ledger: TimeLedger) -> None:
        ledger.tail["offload"] += 2 * ledger.links.copy(1e6)


def test_a_new_technique_is_folded_without_a_change_to_the_planner(monkeypatch):
    facts, plan = _facts("mlp"), P("pipeline", 2, 2, 4)
    plain, plain_time = predict(facts, plan), step_time(facts, LINKS, plan, 16)
    for module in (estimate, time_model):
        monkeypatch.setattr(module, "TECHNIQUES", (*TECHNIQUES, _Disk()))
    est, timed = predict(facts, plan), step_time(facts, LINKS, plan, 16)
    for before, after in zip(plain.ranks, est.ranks):
        assert (after.optimizer, after.disk) == (0, before.optimizer)
        assert after.peak == before.peak - before.optimizer and after.host == 0
    assert est.disk == plain.ranks[0].optimizer and "disk" in est.format_table().splitlines()[1]
    assert timed.offload == pytest.approx(2 * LINKS.copy(1e6))
    assert timed.seconds == pytest.approx(plain_time.seconds + 2 * LINKS.copy(1e6))


def _measured(name: str, **measured) -> ModelFacts:
    facts = _facts(name)
    return dataclasses.replace(facts, times=dataclasses.replace(facts.times, measured=measured))


def test_fsdp2_s_time_reads_its_in_place_measurement_per_unit():
    plan, none = P("pipeline", 2, 1, 2, data_parallel="fsdp"), Line()
    zero = FsdpTimes(2, none, none, none, none)
    base = step_time(_measured("mlp", fsdp=zero), LINKS, plan, 8)
    facts = _facts("mlp")
    units = sum(1 for u in facts.layout.units if facts.unit_params.get(u.name))  # each layer with weights
    gathered = step_time(_measured("mlp", fsdp=FsdpTimes(2, Line(1e-3), none, none, none)), LINKS, plan, 8)
    assert gathered.seconds - base.seconds == pytest.approx(units * 1e-3)  # before the first forward
    reduced = step_time(_measured("mlp", fsdp=FsdpTimes(2, none, none, none, Line(2e-4))), LINKS, plan, 8)
    assert reduced.communication - base.communication == pytest.approx(units * 2e-4)  # (the roots: none)
    # FSDP2's hooks: every unit and the stage's root, on each of the 2 micro-batches' forwards.
    hooked = step_time(_measured("mlp", fsdp=FsdpTimes(2, none, Line(3e-4), none, none)), LINKS, plan, 8)
    assert hooked.seconds - base.seconds == pytest.approx(2 * (len(facts.layout.units) + 1) * 3e-4)
    # A line in the unit's bytes, on every micro-batch's backward (2 of them): the root has none.
    nbytes = sum(t.nbytes for t in _facts("mlp").tensors.values())
    slope = step_time(_measured("mlp", fsdp=FsdpTimes(2, none, none, Line(0, 1e-9), none)), LINKS, plan, 8)
    assert slope.seconds - base.seconds == pytest.approx(2 * 1e-9 * nbytes)
    # The optimizer on the DTensor shards beyond plain tensors: a line in the unit's bytes, once a step.
    on_shards = FsdpTimes(2, none, none, none, none, Line(0, 1e-9))
    stepped = step_time(_measured("mlp", fsdp=on_shards), LINKS, plan, 8)
    assert stepped.optimizer - base.optimizer == pytest.approx(1e-9 * nbytes)
    assert stepped.seconds - base.seconds == pytest.approx(1e-9 * nbytes)
    # Unmeasured: the links' all-gather and reduce-scatter, with every unit's latency.
    assert step_time(_facts("mlp"), LINKS, plan, 8).seconds != base.seconds


def test_tensor_parallelism_s_time_reads_its_split_block_measured_in_place():
    plan, facts = P("pipeline", 2, 1, 2, tensor_parallel_size=2), _facts("tp")
    split = [u.name for u in facts.layout.units if facts.tp_reduces.get(u.name)]
    zero = TensorParallelTimes({2: BlockTimes(Line(), Line())})  # (nothing beyond the local model's)
    measured = TensorParallelTimes({2: BlockTimes(Line(5e-3), Line(7e-3))})
    base = step_time(_measured("tp", tensor_parallel=zero), LINKS, plan, 8)
    timed = step_time(_measured("tp", tensor_parallel=measured), LINKS, plan, 8)
    own = [facts.times.units[n] for n in split]
    extra = sum((5e-3 - u.forward.at(4)) + (7e-3 - u.backward.at(4)) for u in own)
    assert split and timed.seconds - base.seconds == pytest.approx(2 * extra)  # 2 micro-batches of 4
    assert timed.communication - base.communication == pytest.approx(2 * extra)
    # Recomputed, unmeasured under checkpointing: a split block's forward runs on DTensors again in
    # backward, charged twice.
    ac = dataclasses.replace(plan, activation_checkpointing=True)
    base_ac = step_time(_measured("tp", tensor_parallel=zero), LINKS, ac, 8)
    timed_ac = step_time(_measured("tp", tensor_parallel=measured), LINKS, ac, 8)
    again = sum(5e-3 - u.forward.at(4) for u in own)
    assert timed_ac.seconds - base_ac.seconds == pytest.approx(2 * (extra + again))
    assert timed_ac.recompute - base_ac.recompute == pytest.approx(2 * again)
    # Measured under checkpointing (what the split block's backward takes more, its forward run again on
    # DTensors): that, not its forward, beyond the local unit's forward that recomputation charges.
    checkpointed = TensorParallelTimes({2: BlockTimes(Line(5e-3), Line(7e-3), Line(9e-3))})
    timed_ck = step_time(_measured("tp", tensor_parallel=checkpointed), LINKS, ac, 8)
    again_ck = sum(9e-3 - u.forward.at(4) for u in own)
    assert timed_ck.seconds - base_ac.seconds == pytest.approx(2 * (extra + again_ck))
    assert timed_ck.recompute - base_ac.recompute == pytest.approx(2 * again_ck)
    # Another tensor-parallel size than the one measured: the links' all-reduces, as unmeasured.
    other = TensorParallelTimes({4: BlockTimes(Line(5e-3), Line(7e-3))})
    unmeasured = step_time(facts, LINKS, plan, 8)
    assert step_time(_measured("tp", tensor_parallel=other), LINKS, plan, 8).seconds == unmeasured.seconds


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    recorded = {name: _numbers(f, plan, samples, acc) for name, f, plan, samples, acc in CASES}
    PINS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(recorded)} plans in {PINS}")
