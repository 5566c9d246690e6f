"""What a user passes survives every launcher: each public object pickles, and a lambda is named.

A spawn launch (``strategy="ddp_spawn"``, ``start_method="spawn"``) pickles the Trainer with its
strategy, callbacks and data loaders. Every public class and every helper's result, built with its
documented arguments, must come back from pickle working; a user's callable that cannot be pickled is
refused in the main process, before any rank starts, naming where it was given and the fix. No test
here starts a process: the pickling fails first.
"""

import copy
import inspect
import multiprocessing
import pickle
import typing

import pytest
import torch
from tiny_models import SequentialRegressor, loader, regression_data

import lightning_parallel
from lightning_parallel import (
    AllReducedMetrics,
    CheckpointWriteError,
    CollectiveOutsideStepError,
    EvalDistributedSampler,
    GradientAccumulationScheduler,
    HangWatchdog,
    ParallelPlan,
    PipelineStrategy,
    PipelineTimeline,
    Rank0Checkpoint,
    ResumableDistributedSampler,
    TokenWeightedLoss,
    estimate_memory,
    labelled_tokens,
    pad_to_multiple,
    padding_to_multiple,
)

BATCH = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.tensor([[-100, 1, 2, 3, -100]] * 2)}


def _collate(samples: list) -> dict:  # a user's collate function, at the top level of a module
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def _samples() -> list[dict]:
    return [{k: v[i] for k, v in BATCH.items()} for i in range(2)]


def _estimate():
    model = SequentialRegressor()
    return estimate_memory(model, (torch.randn(8, 8), torch.randn(8, 4)), devices=2, strategy="ddp")


# name -> (what the user builds from the documented arguments, what must survive the round trip)
CASES = {
    "AllReducedMetrics": (lambda: AllReducedMetrics(rank_stats=True), lambda o: o.reduce),
    "CheckpointWriteError": (lambda: CheckpointWriteError("disk full"), str),
    "CollectiveOutsideStepError": (lambda: CollectiveOutsideStepError("all_reduce"), str),
    "EvalDistributedSampler": (lambda: EvalDistributedSampler(range(10), num_replicas=2, rank=1), list),
    "GradientAccumulationScheduler": (
        lambda: GradientAccumulationScheduler(global_batch_size={0: 8, 100: 16}),
        lambda o: o.state_key,
    ),
    "HangWatchdog": (lambda: HangWatchdog(timeout=60, report_path="hang.txt"), lambda o: o.report_path),
    "PipelineStrategy": (
        lambda: PipelineStrategy(pipeline_size=2, num_microbatches=8, schedule="gpipe", start_method="spawn"),
        lambda o: o.parallel_plan,
    ),
    "ParallelPlan": (
        lambda: ParallelPlan(pipeline_size=2, data_parallel="zero1", activation_checkpointing=["h.1"]),
        lambda o: o.code(),
    ),
    "PipelineTimeline": (lambda: PipelineTimeline(steps=[3, 4], dirpath="timeline"), lambda o: o.steps),
    "Rank0Checkpoint": (
        lambda: Rank0Checkpoint(dirpath="ckpt", monitor="val_loss", save_last=True, async_save=True),
        lambda o: o.state_key,
    ),
    "ResumableDistributedSampler": (
        lambda: ResumableDistributedSampler(range(10), num_replicas=2, rank=0, seed=3),
        list,
    ),
    "TokenWeightedLoss": (
        lambda: TokenWeightedLoss(count=labelled_tokens("labels", shift=True)),
        lambda o: o.count(BATCH),
    ),
    "labelled_tokens": (lambda: labelled_tokens("labels", ignore_index=1, shift=True), lambda o: o(BATCH)),
    "padding_to_multiple": (
        lambda: padding_to_multiple(_collate, 8, {"labels": -100}),
        lambda o: o(_samples())["labels"],
    ),
    "pad_to_multiple": (lambda: pad_to_multiple(BATCH, 8, {"labels": -100}), lambda o: o["labels"]),
    "estimate_memory": (_estimate, lambda o: o.format_table()),
}
# Their results are plain values (a path, a list of names): nothing of the user's travels in them.
PLAIN_RESULTS = {"consolidate_checkpoint": str, "load_pretrained": list[str]}


def test_every_public_name_is_covered():
    public = set(lightning_parallel.__all__) - {"__version__"}
    assert set(CASES) | set(PLAIN_RESULTS) == public
    for name, result in PLAIN_RESULTS.items():
        assert typing.get_type_hints(getattr(lightning_parallel, name))["return"] == result


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_public_object_and_helper_result_comes_back_from_pickle_working(name):
    build, seen = CASES[name]
    original = build()
    restored = pickle.loads(pickle.dumps(original))
    assert type(restored) is type(original)
    expected, got = seen(original), seen(restored)
    if torch.is_tensor(expected):
        assert torch.equal(got, expected)
    else:
        assert got == expected
    public = getattr(lightning_parallel, name)
    assert pickle.loads(pickle.dumps(public)) is public  # the class or function itself, by reference


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(plan="auto", memory="1GiB", global_batch_size=16),
        dict(pipeline_size=2, offload=["optimizer", "activations"]),
    ],
    ids=["plan-auto", "offload"],
)
def test_the_strategy_with_a_planned_or_offloaded_plan_comes_back_from_pickle(kwargs):
    original = PipelineStrategy(start_method="spawn", **kwargs)
    restored = pickle.loads(pickle.dumps(original))
    assert restored.parallel_plan == original.parallel_plan
    assert restored._auto == original._auto  # what plan="auto" is asked (budget, global batch), or None


# ---------------------------------------------------------------------- a user's lambda, by name
def _spawn_trainer(**kwargs):
    from mp_harness import quiet_trainer

    return quiet_trainer(devices=2, max_steps=1, **kwargs)


def _ddp_spawn(**kwargs):
    return _spawn_trainer(strategy="ddp_spawn", **kwargs)  # Lightning's own launcher, start_method="spawn"


def _pipeline_spawn(**kwargs):
    return _spawn_trainer(strategy=PipelineStrategy(pipeline_size=2, start_method="spawn", **kwargs))


LAMBDAS = {
    "TokenWeightedLoss under ddp_spawn": (
        lambda: (_ddp_spawn(callbacks=[TokenWeightedLoss(count=lambda batch: 1)]), None),
        r"TokenWeightedLoss\(count=\S*<lambda> \(test_picklable.py:\d+\)\) cannot be pickled",
    ),
    "padding_to_multiple in a loader under ddp_spawn": (
        lambda: (_ddp_spawn(), padding_to_multiple(lambda samples: samples, 8)),
        r"padding_to_multiple\(collate_fn=\S*<lambda> \(test_picklable.py:\d+\), multiple=8\) cannot be",
    ),
    "PipelineStrategy(parallelize_fn=) under start_method=spawn": (
        lambda: (_pipeline_spawn(parallelize_fn=lambda module, mesh: module), None),
        r"PipelineStrategy\(parallelize_fn=\S*<lambda> \(test_picklable.py:\d+\)\) cannot be pickled",
    ),
    "PipelineStrategy(activation_checkpointing=) under start_method=spawn": (
        lambda: (_pipeline_spawn(activation_checkpointing=lambda name, module: True), None),
        r"PipelineStrategy\(activation_checkpointing=\S*<lambda> \(test_picklable.py:\d+\)\) cannot be",
    ),
}


@pytest.mark.parametrize("case", sorted(LAMBDAS))
def test_a_lambda_under_a_spawn_launch_is_named_with_the_fix_before_any_rank_starts(case):
    build, names = LAMBDAS[case]
    trainer, collate = build()
    data = loader(regression_data(16), 8)
    if collate is not None:
        data = torch.utils.data.DataLoader(regression_data(16), batch_size=8, collate_fn=collate)
    with pytest.raises(pickle.PicklingError, match=names) as raised:
        trainer.fit(SequentialRegressor(), data)
    assert "define it with `def` at the top level of a module" in str(raised.value)
    assert "start_method='popen'" in str(raised.value)
    assert multiprocessing.active_children() == []


def test_copies_keep_a_lambda_without_pickling_it():
    count = lambda batch: 1  # noqa: E731
    callback = TokenWeightedLoss(count=count)
    assert copy.deepcopy(callback).count is count and copy.copy(callback).count is count
    collate = padding_to_multiple(count, 8)
    assert copy.deepcopy(collate).collate_fn is count


def test_the_error_names_a_function_where_it_is_defined():
    from lightning_parallel._picklable import describe

    def local_count(batch):
        return 1

    line = inspect.getsourcelines(local_count)[1]
    assert describe(local_count) == (
        f"test_the_error_names_a_function_where_it_is_defined.<locals>.local_count (test_picklable.py:{line})"
    )
    with pytest.raises(pickle.PicklingError, match=r"TokenWeightedLoss\(count=test_the_error_names"):
        pickle.dumps(TokenWeightedLoss(count=local_count))
