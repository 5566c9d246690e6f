"""PipelineStrategy(plan="auto"): the arguments, the choice with its margin, nothing fits, the trials' choice,
and one spawned job in which the auto-planned run computes exactly what the same plan given by hand computes
(also with trials=2: strategies/pipeline/trials.py; the techniques measured in place: planner/in_place.py;
what plan="auto" measures on the job's ranks: strategies/pipeline/auto_measure.py)."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback
from mp_harness import quiet_trainer, spawn_gloo
from tiny_models import FlatRegressor, SequentialRegressor, loader
from torch.utils.data import TensorDataset

from lightning_parallel import GradientAccumulationScheduler, ParallelPlan, PipelineStrategy
from lightning_parallel.planner.advice import NothingFits, choose
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import given_links
from lightning_parallel.planner.ranking import Budget, plan_search
from lightning_parallel.planner.search import Search
from lightning_parallel.strategies.pipeline import autoplan
from lightning_parallel.strategies.pipeline.trials import Trial

LINKS = given_links(bandwidth=10e9, latency=1e-5)


def test_plan_auto_takes_its_budgets_and_refuses_what_it_chooses():
    strategy = PipelineStrategy(plan="auto", memory="24GiB", host_memory=2**30, global_batch_size=64)
    assert strategy._auto == autoplan.AutoRequest(24 * 2**30, 2**30, 64)
    kept = PipelineStrategy(plan="auto", memory="1GiB", save_distributed_checkpoint=True)
    assert kept._auto.kept == {"save_distributed_checkpoint": True}
    with pytest.raises(
        ValueError, match=r"plan='auto' chooses num_microbatches, pipeline_size: leave them out"
    ):
        PipelineStrategy(plan="auto", pipeline_size=2, num_microbatches=8)
    with pytest.raises(ValueError, match=r"memory: only for plan='auto': pass plan='auto' too"):
        PipelineStrategy(memory="24GiB")
    with pytest.raises(ValueError, match="plan must be 'auto'"):
        PipelineStrategy(plan="fastest")
    assert PipelineStrategy(plan="auto", memory="1GiB", trials=3)._auto.trials == 3
    assert PipelineStrategy(plan="auto", memory="1GiB")._auto.trials == 1  # (off by default)
    with pytest.raises(ValueError, match=r"trials: only for plan='auto': pass plan='auto' too"):
        PipelineStrategy(pipeline_size=2, trials=2)
    for bad in (0, True, 2.5, "3"):
        with pytest.raises(ValueError, match=rf"trials must be the number of predicted plans .*got {bad!r}"):
            PipelineStrategy(plan="auto", memory="1GiB", trials=bad)
    with pytest.raises(ValueError, match="cannot read the memory size 'lots'"):
        PipelineStrategy(plan="auto", memory="lots")
    with pytest.raises(
        ValueError, match=r"a cpu device does not report: pass memory= \(e.g. PipelineStrategy"
    ):
        autoplan.device_memory(torch.device("cpu"))
    assert '        plan: ``"auto"``: the planner chooses' in PipelineStrategy.__doc__


def test_the_global_batch_is_made_up_by_the_accumulation_scheduler():
    strategy = SimpleNamespace(
        _auto=autoplan.AutoRequest(2**30, global_batch_size=32), root_device=torch.device("cpu")
    )
    trainer = SimpleNamespace(callbacks=[])
    autoplan.prepare(strategy, trainer)
    assert [type(c) for c in trainer.callbacks] == [GradientAccumulationScheduler]
    assert trainer.callbacks[0].global_batch_size == {0: 32}
    autoplan.prepare(strategy, trainer)  # the same global batch given twice: one scheduler
    assert len(trainer.callbacks) == 1
    with pytest.raises(
        ValueError, match=r"global_batch_size=32.*disagree: give the global batch in one place"
    ):
        autoplan.prepare(
            strategy, SimpleNamespace(callbacks=[GradientAccumulationScheduler(global_batch_size=64)])
        )
    no_memory = SimpleNamespace(_auto=autoplan.AutoRequest(), root_device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs the memory of each device"):
        autoplan.prepare(no_memory, SimpleNamespace(callbacks=[]))


@pytest.fixture(scope="module")
def facts():
    torch.manual_seed(0)
    model = SequentialRegressor(d_in=16, hidden=64, depth=6, adam=True)
    return {1: measure_model(model, (torch.randn(16, 16), torch.randn(16, 4)), time_sizes=(2, 8))}


def test_the_choice_is_the_fastest_that_fits_with_the_margin(facts):
    search = Search(devices=2, global_batch_size=16, offload=False)
    candidates = plan_search(facts, search, LINKS)
    fastest = candidates[0]
    # A budget the fastest plan fills to 95%: over the 90% the margin leaves, so the next one that fits.
    budget = Budget(int(fastest.peak / 0.95), margin=0.1)
    chosen = choose(facts, search, budget, LINKS, candidates)
    assert chosen is not fastest and chosen.peak <= 0.9 * budget.device
    assert all(c.peak > budget.usable for c in candidates[: candidates.index(chosen)])
    assert choose(facts, search, Budget(int(fastest.peak / 0.95), margin=0.0), LINKS, candidates) is fastest
    assert Budget(100, host=50, margin=0.1).usable_host == 45


def test_nothing_fits_names_the_smallest_peak_the_miss_and_what_would_fit(facts):
    search = Search(devices=2, global_batch_size=16, offload=False)
    candidates = plan_search(facts, search, LINKS)
    smallest = min(c.peak for c in candidates)
    with pytest.raises(NothingFits) as caught:
        choose(facts, search, Budget(int(smallest * 0.8)), LINKS, candidates)
    message = str(caught.value)
    assert "no plan fits" in message and "the smallest device peak is" in message and "usable" in message
    assert "  - 4 devices: smallest peak" in message and "  - a batch of 4 per replica" in message
    assert "  - offload" in message  # (not in the search: how small it would make the peak)
    # No plan at all: what cannot be split, and the nearest global batches that can be.
    unsplit = (
        r"no plan splits the global batch \(7\) over 2 devices \(pp 1x2: 7 is not a multiple .*e\.g\. 6 or 8$"
    )
    with pytest.raises(NothingFits, match=unsplit):
        choose(facts, Search(devices=2, global_batch_size=7), Budget(2**30), LINKS)


def test_trials_keep_the_fastest_measured_per_sample_and_say_why():
    one, two, three = (ParallelPlan("pipeline", 2, p, m) for p, m in ((1, 1), (2, 2), (1, 2)))
    tried = [
        Trial(one, predicted=0.010, samples=16, measured=0.030),
        Trial(two, predicted=0.012, samples=16, measured=0.020),
        Trial(three, predicted=0.013, samples=16, error="RuntimeError: out of memory"),
    ]
    plan, report = autoplan._best_measured(tried, one)
    assert plan is two
    assert "chosen: pp 2x1 1f1b m=2 (the fastest measured; ranked 2 of 3 by prediction)" in report
    assert "failed: RuntimeError: out of memory" in report and "1.67" in report  # 20 ms over 12 ms predicted
    # Per sample: a plan that steps twice as many samples may take up to twice as long.
    more = [Trial(one, 0.01, 16, measured=0.030), Trial(two, 0.01, 32, measured=0.050)]
    assert autoplan._best_measured(more, one)[0] is two
    # None ran: the fastest predicted plan runs.
    failed = [Trial(one, 0.01, 16, error="ValueError: no"), Trial(two, 0.01, 16, error="ValueError: no")]
    assert autoplan._best_measured(failed, one) == (one, autoplan._best_measured(failed, one)[1])
    assert "no trial ran: the fastest predicted plan runs" in autoplan._best_measured(failed, one)[1]


class _PlanSeen(Callback):
    """What a user's hook reads of the running plan: its label and its code (both need its devices)."""

    def __init__(self, records: dict, key: str) -> None:
        self.records, self.key = records, key

    def on_train_start(self, trainer, pl_module) -> None:
        plan = trainer.strategy.parallel_plan
        self.records[self.key] = (plan.label(), plan.code())


MODELS = {"sequential": lambda: SequentialRegressor(adam=True, depth=4), "flat": FlatRegressor}
"""A model the pipeline can split, and one it cannot (run whole: the search offers pipeline_size=1)."""


TINY = autoplan.Measurement(link_sizes=(1 << 10, 1 << 16), link_repeats=1, repeats=1, overhead_steps=(0, 0),
                            trial_steps=(1, 1))  # fmt: skip
"""What the job measures before it plans: a step and one repeat of everything (the suite's time); what every
step pays is measured in the run with trials only (a trivial stage built twice, the model run as replicas)."""


def _job(rank: int, world: int, out_dir: str) -> None:
    autoplan.MEASURE = TINY
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    records = {}
    for model_name, make in MODELS.items():
        # The Sequential model also with trials=2: the two fastest predicted plans run on the job's ranks.
        variants = ("auto", "hand") + (("trials", "trials_hand") if model_name == "sequential" else ())
        for name in variants:
            key = f"{model_name}_{name}"
            plan_key = f"{model_name}_plan" if name in ("auto", "hand") else f"{model_name}_trials_plan"
            torch.manual_seed(0)
            if name in ("auto", "trials"):
                trials = 2 if name == "trials" else None
                autoplan.MEASURE = replace(TINY, overhead_steps=(1, 1)) if trials else TINY
                strategy = PipelineStrategy(plan="auto", memory="1GiB", global_batch_size=16, trials=trials)
                callbacks = []
            else:
                strategy = PipelineStrategy.from_plan(records[plan_key])
                callbacks = [GradientAccumulationScheduler(global_batch_size=16)]
            callbacks.append(_PlanSeen(records, f"{key}_seen"))
            trainer = quiet_trainer(devices=world, strategy=strategy, callbacks=callbacks, max_steps=3)
            model = make()
            trainer.fit(model, loader(data, 4))
            records[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            records[plan_key] = trainer.strategy.parallel_plan
            records[f"{key}_loss"] = float(trainer.callback_metrics["train_loss"])
            planned = trainer.strategy.planned
            if planned is not None:  # (rank 0's)
                records[f"{key}_planned"] = (planned.trials, planned.notes, planned.links.describe())
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_plan_auto_runs_exactly_the_plan_given_by_hand(tmp_path):
    spawned = spawn_gloo(_job, 2, tmp_path)
    for rank, r in enumerate(spawned):
        for model_name in MODELS:
            plan: ParallelPlan = r[f"{model_name}_plan"]
            auto, hand = r[f"{model_name}_auto"], r[f"{model_name}_hand"]
            assert plan.strategy == "pipeline" and plan.pipeline_size in (1, 2), plan
            assert set(auto) == set(hand) and auto
            for key in auto:
                assert torch.equal(auto[key], hand[key]), (rank, plan.code(), key)
            assert r[f"{model_name}_auto_loss"] == r[f"{model_name}_hand_loss"]
            # The running plan knows its devices: a hook can log what ran, chosen or given by hand.
            assert plan.devices == 2 and r[f"{model_name}_auto_seen"] == (plan.label(), plan.code())
            assert r[f"{model_name}_hand_seen"] == r[f"{model_name}_auto_seen"], rank
        # A model with nothing to split is still planned: pipeline_size=1 (replicas, ZeRO-1, offload).
        assert r["flat_plan"].pipeline_size == 1 and r["flat_plan"].data_parallel_size == 2
        # trials=2: the run is the plan the trials kept, computed exactly as that plan given by hand.
        for key in r["sequential_trials"]:
            assert torch.equal(r["sequential_trials"][key], r["sequential_trials_hand"][key]), key
        assert r["sequential_trials_loss"] == r["sequential_trials_hand_loss"]
        assert ("sequential_trials_planned" in r) == (rank == 0)  # (what rank 0 weighed)
    trials, notes, links = spawned[0]["sequential_trials_planned"]
    assert len(trials) == 2 and all(t.measured and t.measured > 0 for t in trials), trials
    kept = min(trials, key=lambda t: t.per_sample)
    assert spawned[0]["sequential_trials_plan"].label() == kept.plan.label()
    # Measured on the job: the curves, what every step pays, FSDP2 in place (a split Sequential).
    assert "all-reduce 1 KiB" in links and "every step pays" in links and "Lightning's loop" in links
    assert "fsdp measured in place" in notes, notes
    # The model itself run as replicas at two windows: its stages' ratio as run and its step's extra.
    assert any("the model run as replicas on 4 samples" in n and "facts' lines" in n for n in notes), notes
    assert not spawned[0]["sequential_auto_planned"][0]  # (no trials without trials=)
    assert not any("run as replicas" in n for n in spawned[0]["sequential_auto_planned"][1])  # (off)
