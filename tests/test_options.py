"""A misspelt or unknown option of every public class is a TypeError naming it and the closest valid one."""

import inspect

import pytest
import torch

import lightning_parallel
from lightning_parallel import (
    AllReducedMetrics,
    EvalDistributedSampler,
    GradientAccumulationScheduler,
    HangWatchdog,
    ParallelPlan,
    PipelineStrategy,
    PipelineTimeline,
    Rank0Checkpoint,
    ResumableDistributedSampler,
    TokenWeightedLoss,
    labelled_tokens,
)
from lightning_parallel._options import unknown_option_error

DATA = list(range(8))

# (class, valid arguments, misspelt option, the option meant)
CASES = [
    (PipelineStrategy, dict(pipeline_size=2), "num_microbatch", "num_microbatches"),
    (GradientAccumulationScheduler, dict(global_batch_size=64), "schedulling", "scheduling"),
    (Rank0Checkpoint, dict(dirpath="ckpt"), "montor", "monitor"),
    (AllReducedMetrics, dict(), "rank_stat", "rank_stats"),
    (HangWatchdog, dict(), "timout", "timeout"),
    (PipelineTimeline, dict(steps=[3]), "dir_path", "dirpath"),
    (EvalDistributedSampler, dict(dataset=DATA), "num_replica", "num_replicas"),
    (ResumableDistributedSampler, dict(dataset=DATA), "shufle", "shuffle"),
    (TokenWeightedLoss, dict(count=labelled_tokens()), "counts", "count"),
    (ParallelPlan, dict(pipeline_size=2), "num_microbatch", "num_microbatches"),
]


def test_every_public_class_is_covered():
    public = {n for n in lightning_parallel.__all__ if inspect.isclass(getattr(lightning_parallel, n))}
    exceptions = {n for n in public if issubclass(getattr(lightning_parallel, n), Exception)}
    assert {c.__name__ for c, *_ in CASES} == public - exceptions


@pytest.mark.parametrize(("cls", "kwargs", "typo", "meant"), CASES, ids=[c[0].__name__ for c in CASES])
def test_a_misspelt_option_names_the_one_meant(cls, kwargs, typo, meant):
    with pytest.raises(
        TypeError, match=rf"{cls.__name__} got an unknown option '{typo}': did you mean '{meant}'\?"
    ):
        cls(**kwargs, **{typo: 1})
    cls(**kwargs)  # the valid arguments alone are fine


def test_an_unknown_option_far_from_any_lists_them_all():
    with pytest.raises(TypeError, match=r"unknown option 'zzz': the options are report_path, timeout"):
        HangWatchdog(zzz=1)


def test_pipeline_strategy_refuses_ddp_options_it_would_not_use():
    with pytest.raises(TypeError, match="unknown option 'bogus_option'"):
        PipelineStrategy(pipeline_size=2, bogus_option=3)
    # DistributedDataParallel's and DDP comm-hook options act on a wrapper this strategy never builds.
    for name in ("find_unused_parameters", "static_graph", "ddp_comm_hook", "model_averaging_period"):
        with pytest.raises(TypeError, match=f"unknown option '{name}'"):
            PipelineStrategy(pipeline_size=2, **{name: None})


def test_pipeline_strategy_passes_on_the_ddp_options_it_honours():
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.plugins.environments import LightningEnvironment

    env, io = LightningEnvironment(), TorchCheckpointIO()
    devices = [torch.device("cpu")] * 2
    strategy = PipelineStrategy(
        pipeline_size=2,
        cluster_environment=env,
        checkpoint_io=io,
        parallel_devices=devices,
        process_group_backend="gloo",
    )
    assert strategy.cluster_environment is env and strategy.checkpoint_io is io
    assert strategy.parallel_devices == devices and strategy.process_group_backend == "gloo"
    assert strategy._ddp_kwargs == {}


def test_the_signature_stays_the_constructors():
    assert "montor" not in inspect.signature(Rank0Checkpoint).parameters
    assert list(inspect.signature(HangWatchdog).parameters) == ["timeout", "report_path"]


def test_the_error_message():
    err = unknown_option_error("X", "sav_last", ["save_last", "save_top_k"])
    assert str(err) == "X got an unknown option 'sav_last': did you mean 'save_last'?"
