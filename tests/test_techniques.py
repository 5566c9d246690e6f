"""The technique contract (techniques/contract.py; the values its members take: techniques/job.py and
techniques/ledgers.py) and the one ordered list (techniques/__init__.py), pure.

What every composer relies on: the list's order, each plan field owned once (by the plan's core or by one
technique), no technique importing another (or the plan, the sources, the strategies, Lightning), the
defaults leaving everything as it is, the folds (labels in the list's order, the environment, the
fields the search decides, the search options each declares: techniques/offload/search_options.py's and
sequence parallelism's, each a Search keyword and a planner flag that reach its variants) and the
optimizer step's sync (grads/sync.py) running the techniques' reductions around the tied weights' sum.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_parallel.grads.sync import GradientSync
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.__main__ import parse_args, search_of
from lightning_parallel.planner.search import SEARCHED_FIELDS, Search
from lightning_parallel.strategies.pipeline.autoplan import SEARCHED
from lightning_parallel.techniques import (
    TECHNIQUES,
    environment,
    predictions,
    search_options,
    searched_fields,
)
from lightning_parallel.techniques.contract import SearchOption, SearchOptions, Technique
from lightning_parallel.techniques.job import Job, Reduction
from lightning_parallel.techniques.ledgers import CostLedger, MemoryLedger, TimeLedger

TECHNIQUES_DIR = Path(__file__).resolve().parents[1] / "lightning_parallel" / "techniques"
CORE_FIELDS = {
    "strategy", "devices", "pipeline_size", "num_microbatches", "schedule", "stages_per_rank", "partition",
    "data_parallel", "precision", "accumulate_grad_batches", "module_name", "split_points",
    "save_distributed_checkpoint",
}  # fmt: skip


def test_the_list_is_torchtitan_s_order():
    names = [t.name for t in TECHNIQUES]
    assert names == [
        "sequence_parallel",
        "causal_attention",
        "recompute",
        "tensor_parallel",
        "user_function",
        "compile",
        "fsdp",
        "zero",
        "overlap",
        "replicas",
        "offload",
    ]  # fmt: skip  (sequence parallelism before recomputation: a recomputed block re-enters its mode)


def test_every_plan_field_is_owned_once_by_the_core_or_by_one_technique():
    owned = [name for t in TECHNIQUES for name in t.fields]
    assert len(owned) == len(set(owned)), owned
    assert set(owned).isdisjoint(CORE_FIELDS)
    assert set(owned) | CORE_FIELDS == {f.name for f in fields(ParallelPlan)}
    for technique in TECHNIQUES:
        assert set(technique.searched) <= set(technique.fields), technique.name


def _unit(path: Path) -> str:
    """The technique a file of techniques/ belongs to (its module, or its folder)."""
    return (
        path.relative_to(TECHNIQUES_DIR).parts[0].removesuffix(".py").lstrip("_").removesuffix("_internals")
    )


def test_no_technique_imports_another_nor_the_floors_above():
    shared = {
        "contract",
        "job",
        "ledgers",
        "attention_masks",
        "",
    }  # the contract and the values it passes; the list
    offending = []
    for path in sorted(TECHNIQUES_DIR.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == TECHNIQUES_DIR:
            continue  # the list imports every technique
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            module = node.module
            names = (
                [f"{module}.{a.name}" for a in node.names]
                if module == "lightning_parallel.techniques"
                else [module]
            )
            for name in names:
                parts = name.split(".")
                if parts[0] == "lightning" or parts[1:2] in (
                    ["plan"],
                    ["sources"],
                    ["strategies"],
                    ["memory"],
                ):
                    offending.append(f"{path.name} imports {name}")
                elif parts[1:2] == ["techniques"]:
                    other = parts[2].lstrip("_").removesuffix("_internals") if len(parts) > 2 else ""
                    if other not in shared and other != _unit(path):
                        offending.append(f"{path.relative_to(TECHNIQUES_DIR)} imports {name}")
    assert not offending, offending


def test_a_technique_s_defaults_leave_everything_as_it_is():
    plan, base = ParallelPlan(devices=2, pipeline_size=2), Technique()
    job = Job(plan, None, torch.device("cpu"), None, nn.Module())
    optimizers = [torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)]
    assert base.normalized(plan) == {} and base.check(plan) is None and base.label(plan) == ""
    assert list(base.variants(plan, SearchOptions())) == [{}]
    assert base.stages(None, job) is None and base.optimizers(optimizers, job) is optimizers
    assert base.step_context(job) is None and base.reductions(job) == []
    output, alone = object(), type("Mesh", (), {"size": lambda self, role: 1})()
    assert base.predictions(output, None, alone) is output
    assert predictions(output, None, alone) is output  # the fold: no technique changes a one-rank prediction
    costs, memory, time = (
        CostLedger(plan, None, 1.0, ["stage"]),
        MemoryLedger(plan, None),
        TimeLedger(plan, None),
    )
    before = (repr(costs), repr(memory), repr(time))
    assert base.stage_costs(costs) is None and base.memory(memory) is None and base.time(time) is None
    assert (repr(costs), repr(memory), repr(time)) == before


def test_labels_follow_the_list_s_order():
    plan = ParallelPlan(devices=8, pipeline_size=2, tensor_parallel_size=2, data_parallel="fsdp",
                        activation_checkpointing=True)  # fmt: skip
    assert plan.label() == "pp 2x2 1f1b m=4 +ac tp=2 +fsdp"
    plan = ParallelPlan(devices=4, pipeline_size=2, data_parallel="zero1", compile=True, offload="optimizer")
    assert plan.label() == "pp 2x2 1f1b m=4 +compile +zero +offload opt"


def test_the_environment_is_what_the_techniques_need_before_the_process_group():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert environment(ParallelPlan(offload="optimizer"), cuda).host_backend is None
    env = environment(ParallelPlan(data_parallel="fsdp", offload="parameters"), cuda)
    assert env.parameters_on_host and env.host_backend.startswith("offload='parameters' keeps FSDP2's")
    with pytest.raises(ValueError, match=r"offload_pin_memory=True page-locks .* drop offload_pin_memory"):
        environment(ParallelPlan(offload="optimizer", offload_pin_memory=True), cpu)
    job = Job(ParallelPlan(offload="optimizer"), None, cuda, None, nn.Module())
    assert job.pin_memory and not Job(job.plan, None, cpu, None, nn.Module()).pin_memory


def test_plan_auto_is_refused_the_fields_the_search_decides():
    assert SEARCHED == SEARCHED_FIELDS
    assert set(SEARCHED) == {
        "pipeline_size", "num_microbatches", "schedule", "stages_per_rank", "activation_checkpointing",
        "data_parallel", "data_parallel_shard_size", "tensor_parallel_size", "offload", "compile",
        "partition", "sequence_parallel_size",
    }  # fmt: skip
    assert set(searched_fields()) <= set(SEARCHED)


def _moved(option: SearchOption) -> tuple[list[str], object]:
    """The command line that moves ``option`` off its default, and the value the search then holds."""
    if option.choices is not None:
        word, value = next((w, v) for w, v in option.choices.items() if v != option.default)
        return [option.flag, word], value
    if isinstance(option.default, bool):
        return [option.flag], not option.default
    return [option.flag, "7"], option.type("7")


def test_each_search_option_is_a_search_keyword_and_a_planner_flag_that_reaches_its_technique_s_variants(
    monkeypatch,
):
    declared = search_options()
    assert {o.name for o in declared} == {"sequence_parallel", "offload", "offload_parameters", "offload_dir"}
    assert len({o.name for o in declared}) == len(declared)  # (one technique owns each)
    seen: dict[str, object] = {}

    def recording(technique: Technique):
        def variants(self, plan, search):
            seen.update({option.name: search.asks(option) for option in technique.search_options})
            yield {}

        return variants

    for technique in TECHNIQUES:
        if technique.search_options:
            monkeypatch.setattr(type(technique), "variants", recording(technique))
    base = ["m:M", "--devices", "2", "--memory", "1GiB", "--global-batch-size", "4"]
    search, _ = search_of(parse_args(base))
    search.plans(num_blocks=2)
    assert seen == {o.name: o.default for o in declared}  # (no flag given: every default)
    for option in declared:
        if option.flag is None:
            continue
        flags, value = _moved(option)
        seen.clear()
        search, _ = search_of(parse_args(base + flags))
        search.plans(num_blocks=2)
        assert seen[option.name] == value, option.flag
        assert search.options == Search(2, 4, ranks_per_node=2, **{option.name: value}).options
    with pytest.raises(TypeError, match="Search got an unknown option 'ofload': did you mean 'offload'"):
        Search(2, 4, ofload=False)
    assert Search(2, 4, offload=False).offload is False  # (read as an attribute, as before)


class _Shared:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def sum_gradients(self) -> None:
        self.calls.append(("tied", ()))


class _Recorded(Reduction):
    def __init__(self, name: str, calls: list, params=(), before_tied_sum=False) -> None:
        self.name, self.calls, self.params, self.before_tied_sum = name, calls, list(params), before_tied_sum

    def __call__(self, finished) -> None:
        self.calls.append((self.name, tuple(finished)))


def test_the_sync_runs_shard_reductions_then_the_tied_sum_then_the_others_each_told_what_is_finished():
    calls: list = []
    module = nn.Linear(2, 2)
    weight, bias = module.weight, module.bias
    shards = _Recorded("shards", calls, [weight], before_tied_sum=True)
    first, second = _Recorded("first", calls, [bias]), _Recorded("second", calls)
    GradientSync(module, _Shared(calls), [first, shards, second], replicas=1)()
    assert calls == [("shards", ()), ("tied", ()), ("first", (weight,)), ("second", (weight, bias))]
