"""The time model without processes: the simulated schedule, the step's terms, the time probe, the links
(curves, their ring rescaling, the overlap), what every step pays."""

from dataclasses import replace

import pytest
import torch
from tiny_models import SequentialRegressor

from lightning_parallel.distributed.link_timing import LinkTimings, OverlapTiming, Timed
from lightning_parallel.plan.parallel_plan import ParallelPlan
from lightning_parallel.planner.calibration import as_run, pipelined_as_run
from lightning_parallel.planner.facts import measure_model
from lightning_parallel.planner.links import Curve, Link, StepOverhead, fit_link, given_links, links_from
from lightning_parallel.planner.optimizer_time import optimizer_step_cost
from lightning_parallel.planner.schedule import Action, rank_actions
from lightning_parallel.planner.time_model import simulate, step_time
from lightning_parallel.planner.time_probe import TimeLine


def _forward_one_backward_two(a: Action) -> float:
    return 1.0 if a.kind == "F" else 2.0


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8)])
def test_equal_stages_give_the_textbook_bubble(schedule, v, p, m):
    sim = simulate(rank_actions(schedule, p, v, m), _forward_one_backward_two)
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    assert sim.makespan == pytest.approx(3 * (v * m + p - 1))  # (v m + p - 1) slots of F + B
    assert sim.imbalance == pytest.approx(1.0)


def test_a_slower_stage_sets_the_pace_and_transfers_add_up():
    actions = rank_actions("1f1b", 2, 1, 8)
    slow = simulate(actions, lambda a: (3.0 if a.stage == 1 else 1.0) * (1 if a.kind == "F" else 2))
    assert slow.imbalance == pytest.approx(1.5)  # 72 / mean(24, 72)
    assert slow.makespan == pytest.approx(72 + 3)  # stage 1 never waits after its first input
    plain = simulate(actions, _forward_one_backward_two)
    sent = simulate(actions, _forward_one_backward_two, transfer=lambda a: 0.5)
    # Every crossing of the boundary on the critical path waits half a slot: the first forward and the
    # last backward at least; the waits show as time spent waiting for a transfer.
    assert sent.makespan >= plain.makespan + 1.0 and sum(sent.waited) > 0
    started = simulate(actions, _forward_one_backward_two, start=[2.0, 2.0])
    assert started.makespan == pytest.approx(plain.makespan + 2.0) and started.bubble == pytest.approx(
        plain.bubble
    )


def test_split_backwards_and_a_deadlock():
    zb = simulate(rank_actions("zbv", 2, 2, 4), _forward_one_backward_two)
    assert zb.bubble < simulate(rank_actions("1f1b", 2, 1, 4), _forward_one_backward_two).bubble
    stuck = [[Action("B", 0, 0)], [Action("F", 1, 0)]]  # stage 0's backward waits for stage 1's
    with pytest.raises(ValueError, match="deadlock"):
        simulate(stuck, _forward_one_backward_two)


@pytest.fixture(scope="module")
def facts():
    torch.manual_seed(0)
    model = SequentialRegressor(d_in=16, hidden=64, depth=6, adam=True)
    return measure_model(model, (torch.randn(16, 16), torch.randn(16, 4)), time_sizes=(2, 8))


def test_the_probe_times_every_unit_and_the_optimizer(facts):
    times = facts.times
    assert times is not None and times.sizes == (2, 8)
    for unit in facts.layout.units:
        t = times.unit(unit.name)
        assert t.forward.at(8) > 0 and t.backward.at(8) > 0, unit.name
    blocks = [times.units[u.name].forward for u in facts.layout.units[1:-1]]
    assert len(set(blocks)) == 1  # units of one structure share their mean
    assert times.step.per_element > 0 and times.host_step.per_element > 0  # (the host's: its fused kernel)
    assert TimeLine(1.0, 0.5).at(2) == 2.0 and TimeLine(-1.0, 0.1).at(1) == 0.0
    cost = optimizer_step_cost(
        [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)], torch.device("cpu")
    )
    assert cost.per_element >= 0 and optimizer_step_cost([], torch.device("cpu")).of(1e6, 10) == 0


def test_the_probe_keeps_a_block_and_the_smallest_unit_with_their_inputs(facts):
    """What the techniques time in place on the job (TimeBench.samples): recorded at the warm-up."""
    block, small = facts.times.samples
    shapes = [tuple(tuple(p.shape) for p in u.module.parameters()) for u in facts.layout.units]
    mine = tuple(tuple(p.shape) for p in block.module.parameters())
    assert shapes.count(mine) == max(shapes.count(s) for s in shapes) > 1  # of the most common structure
    assert 0 < small.nbytes < block.nbytes
    for sample in (block, small):
        assert set(sample.inputs) == {2, 8}
        (x, *_), _kwargs = sample.inputs[8]
        assert x.shape[0] == 8 and x.grad_fn is None  # detached copies


def test_the_step_charges_bubble_recomputation_communication_and_offload(facts):
    fast = given_links(bandwidth=100e9, latency=1e-6, host_bandwidth=50e9)
    slow = given_links(bandwidth=1e6, latency=1e-3, host_bandwidth=1e6)
    pp = step_time(facts, fast, ParallelPlan("pipeline", 2, 2, 4), samples=16)
    assert pp.bubble > 0.1 and pp.seconds > pp.optimizer > 0
    more = step_time(facts, fast, ParallelPlan("pipeline", 2, 2, 8), samples=16)
    assert more.bubble < pp.bubble
    ac = step_time(facts, fast, ParallelPlan("pipeline", 2, 2, 4, activation_checkpointing=True), samples=16)
    assert ac.recompute > 0 and ac.seconds > pp.seconds and pp.recompute == 0
    dp_fast = step_time(facts, fast, ParallelPlan("pipeline", 2, 1, 1), samples=8)
    dp_slow = step_time(facts, slow, ParallelPlan("pipeline", 2, 1, 1), samples=8)
    grads = sum(t.grad for t in facts.tensors.values())
    # One all-reduce of every gradient after the schedule: 2 ring steps of half the bytes on 2 ranks.
    assert dp_slow.communication == pytest.approx(slow.all_reduce(2, grads))
    assert dp_slow.seconds - dp_fast.seconds == pytest.approx(dp_slow.communication - dp_fast.communication)
    zero = step_time(facts, slow, ParallelPlan("pipeline", 2, 1, 1, data_parallel="zero1"), samples=8)
    assert zero.optimizer < dp_slow.optimizer and zero.communication > dp_slow.communication
    offloaded = step_time(facts, slow, ParallelPlan("pipeline", 2, 1, 1, offload="optimizer"), samples=8)
    assert offloaded.offload >= 2 * slow.copy(grads) and offloaded.seconds > dp_slow.seconds
    accumulating = step_time(facts, fast, ParallelPlan("pipeline", 2, 2, 4), samples=16, accumulate=2)
    assert accumulating.schedule == pytest.approx(2 * pp.schedule)
    with pytest.raises(ValueError, match="no unit times"):
        step_time(measure_model(SequentialRegressor(adam=True), (torch.randn(4, 8), torch.randn(4, 4))), fast,
                  ParallelPlan("pipeline", 2, 2, 2), 4)  # fmt: skip


def test_links_fit_two_sizes_and_charge_collectives_as_rings():
    assert fit_link((1000, 2000), (0.002, 0.003)) == Link(0.001, 1e6)
    assert fit_link((1000, 2000), (0.003, 0.002)).latency == 0.0  # noise: the larger message's rate
    links = given_links(bandwidth=1e9, latency=1e-5)
    assert links.all_reduce(1, 1e9) == 0 and links.send(0) == 0
    assert links.all_reduce(4, 4e6) == pytest.approx(2 * 3 * (1e-5 + 1e6 / 1e9))
    assert links.all_gather(4, 4e6) == pytest.approx(links.all_reduce(4, 4e6) / 2)
    with pytest.raises(ValueError, match="positive bandwidth"):
        given_links(bandwidth=0)


# ------------------------------------------------------------------------ curves, overlap, overhead


def test_a_curve_interpolates_log_log_and_keeps_the_latency_below_and_the_rate_above():
    curve = Curve((1e3, 1e5, 1e7), (1e-4, 1e-3, 5e-2))
    assert curve.time(1e3) == 1e-4 and curve.time(1e5) == pytest.approx(1e-3)
    assert curve.time(1e4) == pytest.approx((1e-4 * 1e-3) ** 0.5)  # halfway on the log scale: geometric mean
    assert curve.time(1e6) == pytest.approx((1e-3 * 5e-2) ** 0.5)
    assert curve.time(10) == curve.time(1) == 1e-4 and curve.time(0) == 0  # no cheaper than the smallest
    per_byte = (5e-2 - 1e-3) / (1e7 - 1e5)  # above the largest: the last segment's rate
    assert curve.time(3e7) == pytest.approx(5e-2 + 2e7 * per_byte)
    # A smaller message measured slower than a larger one (a late peer) is taken at the larger one's time.
    assert Curve((1e3, 1e4, 1e5), (3e-4, 1e-4, 2e-4)).seconds == (1e-4, 1e-4, 2e-4)
    assert Curve((1e3,), (2e-4,)).time(4e3) == pytest.approx(8e-4)  # one point: its rate
    with pytest.raises(ValueError, match="increasing"):
        Curve((1e4, 1e3), (1e-4, 2e-4))
    with pytest.raises(ValueError, match="as many seconds as sizes"):
        Curve((1e3, 1e4), (1e-4,))


def _timed(sizes, seconds):
    return Timed(sizes, seconds, tuple(s * 0.9 for s in seconds), tuple(s * 1.2 for s in seconds))


def test_measured_links_are_curves_rescaled_as_rings_for_another_group_size():
    sizes = (1 << 10, 1 << 20, 1 << 24)
    timings = LinkTimings(
        2, "measured on a test's group", {
            "send": _timed(sizes, (1e-4, 1e-3, 1e-2)), "all_reduce": _timed(sizes, (2e-4, 2e-3, 3e-2)),
            "all_gather": _timed(sizes, (1.5e-4, 1e-3, 1.5e-2)), "copy": _timed(sizes, (1e-6, 1e-4, 2e-3)),
            "broadcast": _timed(sizes, (1e-4, 9e-4, 1.2e-2)),
        }, OverlapTiming(compute=0.010, collective=0.008, together=0.014),
    )  # fmt: skip
    links = links_from(timings, overhead=StepOverhead(1e-3))
    assert links.ranks == 2 and links.overlap == pytest.approx(1.5) and links.overhead.per_step == 1e-3
    assert links.send(1 << 20) == pytest.approx(1e-3) and links.copy(1 << 24) == pytest.approx(2e-3)
    assert links.all_reduce(2, 1 << 20) == pytest.approx(2e-3)  # on the curve's own group: the curve
    assert links.all_reduce(1, 1 << 20) == 0 and links.all_gather(2, 0) == 0
    # Four ranks: 3 ring steps of a quarter, each what the 2-rank curve's one step costs at that chunk.
    assert links.all_reduce(4, 1 << 22) == pytest.approx(3 * links.curves["all_reduce"].time(1 << 21))
    # A broadcast moves the whole message at each of its k - 1 steps.
    assert links.broadcast(2, 1 << 20) == pytest.approx(9e-4)
    assert links.broadcast(4, 1 << 20) == pytest.approx(3 * 9e-4)
    # Kinds not timed fall back: a reduce-scatter is an all-gather's; a collective with no curve at all
    # (given links) is the alpha-beta ring.
    assert links.reduce_scatter(2, 1 << 20) == links.all_gather(2, 1 << 20)
    assert links.more_messages(2, 3) == pytest.approx(2 * links.curves["all_gather"].latency)
    assert "all-reduce 1 KiB 0.20 ms" in links.describe() and "spread 30%" in links.describe()
    assert "slows both 1.50x" in links.describe() and "1.00 ms per step" in links.describe()
    given = given_links(bandwidth=1e9, latency=1e-5)
    assert given.reduce_scatter(4, 4e6) == given.all_gather(4, 4e6) and given.all_to_all(4, 4e6) > 0
    assert given.broadcast(4, 1e6) == pytest.approx(3 * (1e-5 + 1e6 / 1e9))
    assert given.more_messages(4, 3) == pytest.approx(2 * 3 * 1e-5)


def test_zero1_broadcasts_each_parameter_on_the_measured_curve(facts):
    sizes = (1 << 10, 1 << 20)
    curves = {"broadcast": Curve(sizes, (2e-4, 1e-3)), "all_reduce": Curve(sizes, (3e-4, 2e-3))}
    links = replace(given_links(bandwidth=1e9, latency=1e-5), curves=curves, ranks=2)
    plain = step_time(facts, links, ParallelPlan("pipeline", 2, 1, 1), samples=8)
    zero = step_time(facts, links, ParallelPlan("pipeline", 2, 1, 1, data_parallel="zero1"), samples=8)
    broadcasts = sum(links.broadcast(2, t.nbytes) for t in facts.tensors.values() if t.grad)
    assert zero.communication - plain.communication == pytest.approx(broadcasts)


def test_overlap_slows_both_while_they_run_at_once():
    assert OverlapTiming(0.010, 0.010, 0.010).slowdown == 1.0  # hidden perfectly
    assert OverlapTiming(0.010, 0.010, 0.020).slowdown == 2.0  # one after the other
    assert OverlapTiming(0.010, 0.004, 0.030).slowdown == 2.0  # (worse than serial: capped)
    links = replace(given_links(bandwidth=1e9), overlap=1.5)
    # 10 ms of backward beside a 4 ms reduction: 4 ms of both at 1/1.5 speed, so 2 ms more than compute.
    assert links.overlapped(0.010, 0.004) == pytest.approx(0.012)
    assert given_links(bandwidth=1e9).overlapped(0.010, 0.004) == pytest.approx(0.010)


def test_what_every_step_pays_is_added_to_every_plan(facts):
    plain = given_links(bandwidth=10e9, latency=1e-5)
    paying = replace(plain, overhead=StepOverhead(per_step=1e-3, per_batch=2e-3, per_action=1e-4))
    assert StepOverhead(1e-3, 2e-3, 1e-4).of(batches=2, actions=8) == pytest.approx(5.8e-3)
    # One stage (replicas): 4 micro-batches, 8 actions, all on the critical path.
    for accumulate in (1, 2):
        plan = ParallelPlan("pipeline", 2, 1, 4)
        base, more = (step_time(facts, links, plan, 8, accumulate) for links in (plain, paying))
        assert more.seconds - base.seconds == pytest.approx(1e-3 + accumulate * (2e-3 + 8 * 1e-4))
        assert more.overhead == pytest.approx(more.seconds - base.seconds) and base.overhead == 0
    pp = ParallelPlan("pipeline", 2, 2, 4)
    assert step_time(facts, paying, pp, 16).seconds > step_time(facts, plain, pp, 16).seconds + 3e-3
    assert "overhead 3.8 ms" in step_time(facts, paying, ParallelPlan("pipeline", 2, 1, 4), 8).describe()


def test_the_model_run_as_replicas_scales_the_stages_and_adds_the_rest_to_every_step(facts):
    trivial = StepOverhead(per_step=1e-3, per_batch=2e-3, per_action=1e-4)
    links = replace(given_links(bandwidth=10e9, latency=1e-5), overhead=trivial)
    replicas = ParallelPlan("pipeline", 2, 1, 1)
    # Steps as a job whose stages run 1.3x their units' timed sum and whose step pays 5 ms more would
    # measure them, at windows of 1 and 3 batches: both read back.
    truth = replace(links, overhead=replace(trivial, per_step=6e-3, compute=1.3))
    measured = {w: step_time(facts, truth, replicas, 8, w).seconds for w in (1, 3)}
    found = as_run(facts, links, replicas, 8, measured)
    assert found.compute == pytest.approx(1.3) and found.per_step == pytest.approx(6e-3)
    assert (found.per_batch, found.per_action) == (trivial.per_batch, trivial.per_action)
    assert "1.30x their units' timed sum" in found.describe()
    assert "timed sum" not in trivial.describe()  # (1: as timed, not said)
    # The ratio scales the facts' lines, so it is taken to them: the links it gives predict the steps it
    # read back, at both windows (with the ratio taken to units timed beside the steps at 0.5x the facts'
    # lines, as the old as_run(units=...) took it, the replicas came out 1.19x and 1.6x over).
    for w in (1, 3):
        assert step_time(facts, replace(links, overhead=found), replicas, 8, w).seconds == pytest.approx(
            measured[w]
        )
    # The ratio scales every plan's stages (not the transfers, the collectives or the optimizer step).
    pp = ParallelPlan("pipeline", 2, 2, 4)
    plain, scaled = (step_time(facts, replace(links, overhead=o), pp, 16) for o in (trivial, found))
    assert scaled.schedule > plain.schedule and scaled.optimizer == plain.optimizer
    assert scaled.seconds - plain.seconds > 5e-3  # (the per-step 5 ms and the slower stages)
    # A difference lost in the noise (3 batches no slower than 1): the units as timed; the step's extra
    # never below zero.
    noisy = as_run(facts, links, replicas, 8, {1: measured[1], 3: measured[1]})
    assert noisy.compute == 1.0 and noisy.per_step >= 0
    fast = as_run(facts, links, replicas, 8, {1: 1e-6, 3: 2e-6})
    assert fast.per_step == 0.0 and fast.compute > 0
    with pytest.raises(ValueError, match="two accumulation windows"):
        as_run(facts, links, replicas, 8, {1: 0.1})
    with pytest.raises(ValueError, match="one stage per rank"):
        as_run(facts, links, pp, 8, measured)


def test_lightnings_loop_is_charged_to_every_plan_and_kept_through_the_fits(facts):
    loop = StepOverhead(per_step=1e-3, loop_step=2e-3, loop_batch=5e-4)
    links = given_links(bandwidth=10e9, latency=1e-5)
    with_loop = replace(links, overhead=loop)
    without = replace(links, overhead=replace(loop, loop_step=0.0, loop_batch=0.0))
    for plan, samples in ((ParallelPlan("pipeline", 2, 1, 2), 8), (ParallelPlan("pipeline", 2, 2, 4), 16)):
        a, b = (step_time(facts, x, plan, samples, 3) for x in (with_loop, without))
        assert a.seconds - b.seconds == pytest.approx(2e-3 + 3 * 5e-4)
    assert "Lightning's loop 2.00 ms per step + 0.50 ms per batch" in loop.describe()
    # The runs the fits read are the strategy's own steps, without the loop: fitted without it, kept.
    replicas, pp = ParallelPlan("pipeline", 2, 1, 1), ParallelPlan("pipeline", 2, 2, 2)
    measured = {w: step_time(facts, without, replicas, 8, w).seconds for w in (1, 3)}
    found = as_run(facts, with_loop, replicas, 8, measured)
    assert (found.loop_step, found.loop_batch, found.per_step) == (2e-3, 5e-4, pytest.approx(1e-3))
    counts = {m: step_time(facts, without, replace(pp, num_microbatches=m), 8).seconds for m in (2, 8)}
    piped = pipelined_as_run(facts, with_loop, pp, 8, counts)
    assert (piped.loop_step, piped.loop_batch) == (2e-3, 5e-4)
    assert piped.pipelined_action == pytest.approx(0.0, abs=1e-12)


def test_a_pipeline_run_at_two_micro_batch_counts_sets_what_pipelined_plans_pay_more(facts):
    replicated = replace(StepOverhead(per_step=1e-3, per_batch=2e-3, per_action=1e-4), compute=1.2)
    links = replace(given_links(bandwidth=10e9, latency=1e-5), overhead=replicated)
    pp = ParallelPlan("pipeline", 2, 2, 2)
    # A job whose pipelined forwards and backwards pay 0.6 ms more each and whose pipelined batch pays
    # 3 ms more: its steps at 2 and 8 micro-batches read both back.
    true = replace(replicated, pipelined_batch=3e-3, pipelined_action=6e-4)
    measured = {m: step_time(facts, replace(links, overhead=true), replace(pp, num_microbatches=m), 8).seconds
                for m in (2, 8)}  # fmt: skip
    found = pipelined_as_run(facts, links, pp, 8, measured)
    assert found.pipelined_action == pytest.approx(6e-4) and found.pipelined_batch == pytest.approx(3e-3)
    assert (found.per_step, found.per_batch, found.compute) == (1e-3, 2e-3, 1.2)  # (the replicas' kept)
    assert "+0.600 ms per forward or backward more" in found.describe()
    # Charged to every plan of several pipeline ranks (here an interleaved one, accumulating), per action
    # and per batch; a plan of one stage per rank pays none of it.
    inter = ParallelPlan("pipeline", 2, 2, 4, schedule="interleaved_1f1b", stages_per_rank=2)
    for plan, samples in ((inter, 16), (pp, 8)):
        as_true, as_found = (
            step_time(facts, replace(links, overhead=o), plan, samples, 2) for o in (true, found)
        )
        assert as_found.seconds == pytest.approx(as_true.seconds)
    replicas = ParallelPlan("pipeline", 2, 1, 4)
    plain, with_found = (
        step_time(facts, replace(links, overhead=o), replicas, 8) for o in (replicated, found)
    )
    assert with_found.seconds == plain.seconds
    assert (
        step_time(facts, replace(links, overhead=found), inter, 16).overhead
        > step_time(facts, links, inter, 16).overhead + 16 * 6e-4
    )
    # Steps faster than the model says (its sends over-charged): taken back, never below what the model
    # charges beside the compute (an action's bookkeeping and one send's latency, a batch's bookkeeping).
    faster = replace(replicated, pipelined_batch=-1e-3, pipelined_action=-5e-5)
    measured_fast = {
        m: step_time(facts, replace(links, overhead=faster), replace(pp, num_microbatches=m), 8).seconds
        for m in (2, 8)
    }
    back = pipelined_as_run(facts, links, pp, 8, measured_fast)
    assert back.pipelined_action == pytest.approx(-5e-5) and back.pipelined_batch == pytest.approx(-1e-3)
    flat = pipelined_as_run(facts, links, pp, 8, {2: 1e-6, 8: 1e-6})
    assert flat.pipelined_action == pytest.approx(-(1e-4 + links.send(1))) and flat.pipelined_batch == -2e-3
    with pytest.raises(ValueError, match="two micro-batch counts"):
        pipelined_as_run(facts, links, pp, 8, {2: 0.1})
    with pytest.raises(ValueError, match="several pipeline ranks"):
        pipelined_as_run(facts, links, replicas, 8, measured)


def test_the_overlapped_reduction_is_charged_only_where_it_outlasts_the_last_backward(facts):
    grads = sum(t.grad for t in facts.tensors.values())
    compute = step_time(
        facts, given_links(bandwidth=1e12), ParallelPlan("pipeline", 2, 1, 1), samples=8
    ).schedule
    slow = given_links(bandwidth=grads / (0.5 * compute))  # (the all-reduce: half the forward + backward)

    def communication(links, **options):
        return step_time(facts, links, ParallelPlan("pipeline", 2, 1, 1, **options), samples=8).communication

    off = communication(slow, overlap_gradient_reduction=False)
    assert off == pytest.approx(slow.all_reduce(2, grads))
    # One bucket (25 MB holds every gradient) starts when the backward ends: nothing hidden.
    assert communication(slow) == pytest.approx(off)
    # 10 kB buckets: all but the last run beside the backward; perfectly overlapped they hide ...
    cap = 0.01
    hidden = communication(slow, bucket_cap_mb=cap)
    assert slow.all_reduce(2, cap * 1024 * 1024) <= hidden < 0.5 * off
    # ... and run serially beside it (the links' measured slowdown 2: no overlap) they hide nothing.
    assert communication(replace(slow, overlap=2.0), bucket_cap_mb=cap) == pytest.approx(off)
    # FSDP2's stages and the split-backward schedules are charged after the schedule, as before.
    assert communication(slow, bucket_cap_mb=cap, schedule="zbv", stages_per_rank=2) >= off
