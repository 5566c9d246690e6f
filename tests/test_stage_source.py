"""pipeline/stage_source.py: both stage sources implement the one interface the runner calls.

Checked on the classes against the Protocol's members (a method missing, or an attribute the runner
reads, fails here rather than mid-fit), and by running a one-stage Sequential source through the
runner's calls without a process group.
"""

import inspect

import torch
from torch import nn

from lightning_parallel.pipeline.stage_source import StageSource
from lightning_parallel.sources.sequential.stages import SequentialStages
from lightning_parallel.sources.traced.stages import TracedStages

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
