"""PipelineStrategy's bad-input errors: clear, raised at construction or setup, never a hang."""

import pytest
import torch
from mp_harness import quiet_trainer
from tiny_models import SequentialRegressor, loader, regression_data
from torch import nn

from lightning_parallel import PipelineStrategy


def _fit(model, devices=1, max_steps=2, batch_size=8, **strategy_kwargs):
    strategy_kwargs.setdefault("num_stages", 1 if devices == 1 else 2)
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
        (dict(num_stages=-1), "num_stages must be a positive int"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**kwargs)


class NoSequential(SequentialRegressor):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


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


class TiedAcrossStages(SequentialRegressor):
    def __init__(self):
        super().__init__(d_in=16, hidden=16, d_out=16)
        self.layers[-1].weight = self.layers[0][0].weight


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "match"),
    [
        (NoSequential, {}, ValueError, r"no top-level nn.Sequential to pipeline: put the layers in one"),
        (TwoSequentials, {}, ValueError, r"several top-level nn.Sequential children \(layers, extra\)"),
        (TwoSequentials, dict(module_name="extra2"), ValueError, r"module_name='extra2' names a NoneType"),
        (ParameterOutside, {}, ValueError, r"parameters outside the pipelined Sequential `layers`: scale"),
        (ManualOptimization, {}, RuntimeError, r"supports automatic optimization only"),
        (SequentialRegressor, dict(num_stages=2), ValueError, r"num_stages \(2\) does not divide"),
        (SequentialRegressor, dict(num_microbatches=16), ValueError, r"batch of 8 samples cannot feed"),
        (
            SequentialRegressor,
            dict(schedule="interleaved_1f1b", stages_per_rank=8),
            ValueError,
            r"num_stages x stages_per_rank \(1 x 8\) is larger than the number of layers in `layers` \(4\)",
        ),
        (
            TiedAcrossStages,
            dict(schedule="interleaved_1f1b", stages_per_rank=2),
            ValueError,
            r"tied weights across pipeline stages are not supported",
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
        _fit(model(), devices=2, max_steps=4, start_method="spawn", partition=[2, 2])
