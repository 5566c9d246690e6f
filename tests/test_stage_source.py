"""pipeline/stage_source.py: both stage sources implement the one interface the runner calls, and the
stage view the techniques act on.

Checked on the classes against the Protocol's members (a method missing, or an attribute the runner or
a technique reads, fails here rather than mid-fit), by running a one-stage Sequential source through the
runner's calls without a process group, and by a traced source's stage prepared in one process: the
techniques' per-stage work runs on it when it is prepared, what it sets runs in the torch stage.
"""

import inspect
import typing

import torch
from tiny_models import TinyGPT
from torch import nn

from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource, UnitNaming
from lightning_parallel.sources.sequential.stages import SequentialStages
from lightning_parallel.sources.traced.stages import TracedStages
from lightning_parallel.sources.twin import alias_table, meta_twin

VIEW = ["stage_indices", "naming", "graphs", "aliases", "block_class", "modules"]  # the data it declares

MEMBERS = [
    name
    for name, value in vars(StageSource).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
]


def test_the_protocol_names_what_the_runner_and_the_techniques_call():
    assert set(MEMBERS) == {
        "needs_example", "shapes_given", "build", "output_merge_spec", "merging", "activate", "each_stage",
        "use_stage_class",
    }  # fmt: skip


def test_the_protocol_declares_the_stage_view_s_facts():
    assert list(typing.get_type_hints(StageSource, include_extras=False)) == VIEW


def test_both_sources_implement_every_member_with_the_protocols_parameters():
    for source in (SequentialStages, TracedStages):
        for name in MEMBERS:
            assert hasattr(source, name), f"{source.__name__} lacks {name}"
            declared = getattr(StageSource, name)
            if isinstance(declared, property):
                continue
            want = list(inspect.signature(declared).parameters)
            got = list(inspect.signature(getattr(source, name)).parameters)
            assert got == want, f"{source.__name__}.{name}{got} against the protocol's {want}"


def test_a_sequential_source_answers_the_runners_calls():
    source: StageSource = SequentialStages([nn.Identity()], [0], 1, torch.device("cpu"), None)
    assert not source.needs_example and not source.shapes_given  # no twins: torch infers the shapes
    assert source.output_merge_spec(4) is None
    with source.merging([1.0, 2.0]):
        pass
    source.activate([])
    seen = []
    source.each_stage(lambda stage: seen.append((stage.index, stage.units)))
    assert seen == [(0, [])]  # an Identity stage module has no layers to wrap
    source.use_stage_class(nn.Module)
    assert source.stage_cls is nn.Module
    assert all(hasattr(source, name) for name in VIEW)
    assert not source.graphs and source.modules == [source.prepared[0].module] and source.block_class is None


class Doubled(nn.Module):
    """What a technique may make a torch stage run in its stage module's place."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return 2 * self.module(*args)


def test_a_sequential_stage_runs_what_a_technique_set_and_is_activated_as_it_said(one_rank):
    """(torch's PipelineStage asks the process group its rank: a world of one in this process.)"""
    layers = nn.Sequential(nn.Linear(2, 2))
    source = SequentialStages([layers], [0], 1, torch.device("cpu"), None, naming=UnitNaming("layers."))
    activated = []

    def wrap(stage: PreparedStage) -> None:
        assert stage.units == [("layers.0", layers[0])] and stage.graph_modules == []
        stage.runs, stage.activate = Doubled(stage.module), lambda: activated.append(stage.index)

    source.each_stage(wrap)
    (built,) = source.build("train", 1, None)
    x = torch.ones(1, 2)
    torch.testing.assert_close(built.submod(x), 2 * layers(x))
    source.activate([built])
    assert activated == [0]


def test_a_traced_stage_gets_the_techniques_per_stage_work_when_it_is_prepared(one_rank):
    model = TinyGPT(depth=2)
    source = TracedStages(meta_twin(model), [], [0], model, alias_table(model), torch.device("cpu"), None,
                          naming=UnitNaming("", "h."))  # fmt: skip
    assert all(hasattr(source, name) for name in VIEW)
    assert source.graphs and source.modules == [model] and source.block_class is None
    seen, activated = [], []

    def wrap(stage: PreparedStage) -> None:
        seen.append([name for name, _ in stage.units])
        assert stage.graph_modules[0] == ("", stage.module)  # (the stage module runs its graph)
        stage.runs, stage.activate = Doubled(stage.module), lambda: activated.append(stage.index)

    source.each_stage(wrap)
    assert seen == []  # nothing prepared yet: a traced stage is prepared at its program's first build
    tokens = torch.randint(0, 13, (2, 8))
    (built,) = source.build("train", 1, (tokens,))
    assert seen == [["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]]
    torch.testing.assert_close(built.submod(tokens), 2 * model(tokens))
    source.activate([built])
    assert activated == [0]
    (again,) = source.build("train", 1, (torch.randint(0, 13, (3, 5)),))  # the same program: prepared once
    assert again.submod is built.submod and len(seen) == 1
    late = []
    source.each_stage(lambda stage: late.append(stage.index))
    assert late == [0]  # given later, it runs now on the stages prepared so far
