"""PipelineStrategy's bad-input errors: clear, raised at construction or setup, never a hang.

Covers plan/checks.py through the strategy (the settings checked at construction),
strategies/pipeline/refusals.py and strategies/pipeline/step.py's
relay of a last-stage error to every rank.
"""

import pytest
import torch
from mp_harness import START_METHOD, quiet_trainer
from tiny_models import SequentialRegressor, TinyGPT, loader, regression_data, token_data
from torch import nn

from lightning_parallel import PipelineStrategy


def _fit(model, devices=1, max_steps=2, batch_size=8, **strategy_kwargs):
    strategy_kwargs.setdefault("pipeline_size", 1 if devices == 1 else 2)
    trainer = quiet_trainer(
        devices=devices, strategy=PipelineStrategy(**strategy_kwargs), max_steps=max_steps
    )
    trainer.fit(model, loader(regression_data(), batch_size))
    return trainer


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(schedule="zigzag"), "unknown schedule 'zigzag': choose one of gpipe, 1f1b, interleaved_1f1b"),
        (dict(schedule="interleaved_1f1b"), "stages_per_rank>=2 with the interleaved"),
        (dict(schedule="1f1b", stages_per_rank=2), "stages_per_rank>=2 with the interleaved"),
        (dict(partition="random"), "unknown partition 'random'"),
        (dict(num_microbatches=0), "num_microbatches must be a positive int"),
        (dict(pipeline_size=-1), "pipeline_size must be a positive int"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**kwargs)


class TwoSequentials(SequentialRegressor):
    def __init__(self):
        super().__init__()
        self.extra = nn.Sequential(nn.Identity())


class ParameterOutside(SequentialRegressor):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.layers(x) * self.scale


class ManualOptimization(SequentialRegressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "match"),
    [
        (TwoSequentials, {}, ValueError, r"several top-level nn.Sequential children \(layers, extra\)"),
        (TwoSequentials, dict(module_name="extra2"), ValueError, r"module_name='extra2' names a NoneType"),
        (ParameterOutside, {}, ValueError, r"parameters outside the pipelined Sequential `layers`: scale"),
        (ManualOptimization, {}, ValueError, r"supports automatic optimization only"),
        (SequentialRegressor, dict(pipeline_size=2), ValueError, r"pipeline_size \(2\) does not divide"),
        (SequentialRegressor, dict(num_microbatches=16), ValueError, r"batch of 8 samples cannot feed"),
        (
            SequentialRegressor,
            dict(schedule="interleaved_1f1b", stages_per_rank=8),
            ValueError,
            r"pipeline_size x stages_per_rank \(1 x 8\) is larger than the number of layers in `layers`",
        ),
    ],
)
def test_bad_models_fail_at_setup(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        _fit(model(), **kwargs)


class DictBetweenStages(SequentialRegressor):
    """Stage 0 ends on a layer that returns a dict: no tensor to send to stage 1."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 4), _ToDict(), _FromDict(), nn.Linear(4, 4))


class _ToDict(nn.Module):
    def forward(self, x):
        return {"x": x}


class _FromDict(nn.Module):
    def forward(self, d):
        return d["x"]


class FailsOnLastStage(SequentialRegressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom in training_step on the last stage")
        return super().training_step(batch, batch_idx)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("model", "match"),
    [
        (DictBetweenStages, r"pipeline stage 0 \(layers \['0', '1'\]\) returned a dict"),
        (FailsOnLastStage, "boom in training_step on the last stage"),
    ],
)
def test_a_failing_rank_ends_the_job_with_its_message(model, match):
    with pytest.raises(Exception, match=match):
        _fit(model(), devices=2, max_steps=4, start_method=START_METHOD, partition=[2, 2])


class BranchesOnValues(TinyGPT):
    def forward(self, idx):
        if idx.sum() > 0:  # a Python branch on a tensor value: torch.export cannot capture it
            return super().forward(idx)
        return super().forward(idx + 1)


class WithBatchNorm(TinyGPT):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)


def _fit_gpt(model, **strategy_kwargs):
    strategy_kwargs.setdefault("pipeline_size", 1)
    trainer = quiet_trainer(devices=1, strategy=PipelineStrategy(**strategy_kwargs), max_steps=1)
    trainer.fit(model, loader(token_data(16), 8))


TRACED_ERRORS = {
    "unknown split point": (
        TinyGPT(), dict(split_points=["h.9"]), ValueError,
        r"TinyGPT has no submodule 'h.9'; the blocks are h.0 .. h.3",
    ),
    "split points do not match the stages": (
        TinyGPT(), dict(split_points=["h.1"]), ValueError,
        r"names 1 stage beginnings \(\['h.1'\]\), which make 2 stages, but the pipeline has 1",
    ),
    "split points out of order": (
        TinyGPT(), dict(split_points=["h.2", "h.1"], stages_per_rank=3, schedule="looped_bfs"), ValueError,
        "in the order forward calls them",
    ),
    "more stages than blocks": (
        TinyGPT(depth=1), dict(stages_per_rank=2, schedule="interleaved_1f1b"), ValueError,
        r"\(1 x 2\) is larger than the number of blocks in `h` \(1\)",
    ),
    "interleaved on one rank": (
        TinyGPT(), dict(stages_per_rank=2, schedule="interleaved_1f1b"), ValueError,
        "stages_per_rank=2 on one pipeline rank",
    ),
    "batch norm": (
        WithBatchNorm(), {}, ValueError, "`norm` is a BatchNorm1d that updates its running statistics"
    ),
    "split points as a string": (
        TinyGPT(), dict(split_points="h.1"), TypeError, "split_points must be a list of module paths"
    ),
    "split points and partition": (
        TinyGPT(), dict(split_points=["h.1"], partition="parameters"), ValueError, "drop partition="
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "match"), list(TRACED_ERRORS.values()), ids=list(TRACED_ERRORS)
)
def test_bad_traced_models_fail_at_setup(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        _fit_gpt(model, **kwargs)


def test_a_forward_torch_export_cannot_capture_says_where_and_the_two_ways_out():
    with pytest.raises(
        RuntimeError, match=r"could not trace BranchesOnValues.forward with torch.export"
    ) as info:
        _fit_gpt(BranchesOnValues())
    message = str(info.value)
    assert "test_pipeline_errors.py:" in message  # where export stopped, in the user's code
    assert "torch.export.export of the module on this batch fails the same way" in message  # checked
    assert "make forward exportable" in message and "top-level nn.Sequential" in message


def test_a_failure_of_the_packages_own_step_says_so_and_asks_for_a_bug_report(monkeypatch):
    """torch.export captures TinyGPT; a step after it (relaying, here made to fail) is this package's."""

    def broken(pipe):
        raise KeyError("add_3")

    monkeypatch.setattr("lightning_parallel.sources.traced.trace.relay_skips", broken)
    with pytest.raises(
        RuntimeError, match=r"its own step `relaying values read past the next stage`"
    ) as info:
        _fit_gpt(TinyGPT())
    message = str(info.value)
    assert "torch.export captured TinyGPT.forward, so the model needs no change" in message
    assert "bug in lightning_parallel: please report it" in message and "KeyError: 'add_3'" in message
    assert "make forward exportable" not in message


def test_a_twin_export_failure_the_module_does_not_have_is_the_packages(monkeypatch):
    """The twin's export fails (made to); torch.export.export of the real module succeeds: ours to fix."""

    def broken(module, example, dynamic=True):
        raise RuntimeError("torch.export could not capture") from ValueError("a stand-in for a twin bug")

    monkeypatch.setattr("lightning_parallel.sources.traced.trace.export_for_pipeline", broken)
    with pytest.raises(
        RuntimeError, match=r"failed in its own step `exporting forward with torch.export`"
    ) as info:
        _fit_gpt(TinyGPT())
    message = str(info.value)
    assert (
        "torch.export.export of the module on this batch succeeds, so TinyGPT.forward needs no change"
        in message
    )
    assert "ValueError: a stand-in for a twin bug" in message and "make forward exportable" not in message
