"""FSDP2 inside pipeline stages: each stage's parameters sharded over its data-parallel ranks (ZeRO-3).

The technique (:data:`TECHNIQUE`, ``data_parallel="fsdp"``, ``data_parallel_shard_size``): its settings
checked, its label, its variant in the search, its transform of the stages (:func:`apply`; per stage
module :func:`shard_stage`, or one root for traced stages, :class:`ShardedTracedStage`) and its gradient
reduction (:class:`ReduceScatter`); for the planner, what it does to a rank's bytes (:func:`memory`,
:meth:`Fsdp.memory`) and to its step's time (the all-gather before the first forward, the reduce-scatter
after the schedule: :meth:`Fsdp.time`).

As torchtitan does: ``fully_shard`` on each block (a child of the stage that holds parameters), then
on the stage root, with ``reshard_after_forward=False`` (under a pipeline a stage runs forward once
per micro-batch: resharding after each would all-gather again for every micro-batch).

A traced stage is an export graph that reads its weights with ``get_attr``: it never calls the user's
blocks, so FSDP hooks put on them would never all-gather them. There the FSDP unit is
:class:`ShardedTracedStage`, a root that holds the user's modules (the same objects, under the same
names) and runs the current input shape's graph: its pre-forward hook all-gathers the whole stage and
``forward`` points the graph's attributes at the unsharded parameters, so the graph reads full weights
and autograd puts its gradients where FSDP reduce-scatters them. The stage stays unsharded for the whole
step (``reshard_after_forward=False``): one all-gather per step per stage, so per-block units would save
no memory there.

Gradients are reduce-scattered once per optimizer step: :class:`DeferredReduceStage` ends each
``schedule.step()`` without reducing (FSDP accumulates the unsharded gradients), and
:func:`reduce_gradients`, called once before the optimizer steps, reduce-scatters the whole
accumulation window's gradients. FSDP divides by the data-parallel size: a mean over the replicas,
as the all-reduce of plain replicas does.
"""

from __future__ import annotations

import copy
import functools
import itertools
import statistics
import time
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_leaves

from lightning_parallel.pipeline.plan import shard_rows
from lightning_parallel.pipeline.stage_source import PreparedStage, StageSource, UnsplitModel
from lightning_parallel.techniques.contract import SearchOptions, Technique
from lightning_parallel.techniques.fsdp._internals import finish_backward
from lightning_parallel.techniques.job import Job, Reduction
from lightning_parallel.techniques.ledgers import Line, MemoryLedger, TimeBench, TimeLedger


class Fsdp(Technique):
    """FSDP2 (``data_parallel="fsdp"``): each stage sharded over its data-parallel ranks, HSDP with a
    ``data_parallel_shard_size`` below them.

    Example::

        ParallelPlan(devices=8, pipeline_size=2, data_parallel="fsdp", data_parallel_shard_size=2).label()
        # 'pp 2x4 1f1b m=4 +hsdp 2x2'
    """

    name, fields, searched = "fsdp", ("data_parallel_shard_size",), ("data_parallel_shard_size",)

    def normalized(self, plan: Any) -> dict[str, Any]:
        shards = plan.data_parallel_shard_size
        if shards is not None:
            if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
                raise ValueError(f"data_parallel_shard_size must be a positive int, got {shards!r}")
            if plan.data_parallel != "fsdp":
                raise ValueError(
                    f"data_parallel_shard_size={shards} shards stages with FSDP2, but data_parallel="
                    f"{plan.data_parallel!r}: use data_parallel='fsdp', or drop data_parallel_shard_size"
                )
        return {}

    def check(self, plan: Any) -> None:
        if plan.data_parallel != "fsdp":
            return
        if plan.strategy != "pipeline":
            raise ValueError(
                f"data_parallel='fsdp' shards the stages of a pipeline, but strategy={plan.strategy!r}: use "
                f"strategy='pipeline' (pipeline_size=1 for FSDP alone)"
            )
        if plan.devices is not None:  # the rank grid refuses a shard size that does not divide the replicas
            plan.layout()

    def label(self, plan: Any) -> str:
        if plan.data_parallel != "fsdp":
            return ""
        replicas = plan.data_parallel_size // plan.shard_size
        return f" +hsdp {replicas}x{plan.shard_size}" if replicas > 1 else " +fsdp"

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        yield {}
        # (the planner models FSDP2's units as the layers of a split nn.Sequential: it tries no other)
        if (
            search.layout == "sequential"
            and plan.data_parallel == "replicate"
            and plan.layout().size("gradients") > 1  # (the replicas x the sequence ranks, which join)
        ):
            yield {"data_parallel": "fsdp"}

    def before_split(self, plan: Any, model: UnsplitModel) -> None:
        if plan.data_parallel == "fsdp" and model.graphs and plan.stages_per_rank > 1:
            raise ValueError(
                f'data_parallel="fsdp" with stages_per_rank={plan.stages_per_rank} is not supported for a '
                f"traced forward: each traced stage is sharded as one FSDP root holding this rank's modules, "
                f"so a rank can hold one stage. Use stages_per_rank=1 (schedule='1f1b' or 'gpipe'), or hold "
                f"the layers in one top-level nn.Sequential"
            )

    def stages(self, view: Any, job: Job) -> str | None:
        if job.plan.data_parallel == "fsdp" and job.table is not None:
            refuse_shared_on_one_rank(job.table)
        return describe(job.mesh) if apply(view, job.plan, job.mesh, job.pin_memory) else None

    def reductions(self, job: Job) -> list[Reduction]:
        roots = sharded_roots(job.stages.modules)  # (a stage a user's parallelize_fn sharded too)
        return [ReduceScatter(roots)] if roots else []

    def memory(self, ledger: MemoryLedger) -> None:
        """The rank's shard of its stages' parameters, and the whole stages gathered for the step
        (:class:`ShardedBytes`); the shard of the optimizer state; the gradients it keeps after the
        reduce-scatter a shard too (its unsharded ones stay in the ``gradients`` column until then)."""
        plan = ledger.plan
        if plan.data_parallel != "fsdp":
            return
        tensors = [ledger.facts.tensors[k] for k in ledger.keys]
        shards = plan.layout().size("shard")  # (the data-parallel shards x the sequence ranks, which join)
        sharded = memory([(t.rows, t.nbytes) for t in tensors], shards)
        ledger.device["parameters"] -= sharded.gathered - sharded.shard
        ledger.device["gathered"] += sharded.gathered
        # The state of each parameter's shard (whole rows; per-tensor state such as Adam's ``step`` stays
        # whole), in place of the whole parameter's.
        ledger.device["optimizer"] -= ledger.facts.state_of(ledger.keys) - state_bytes(tensors, shards)
        ledger.reduced_gradients = memory([(t.rows, t.grad) for t in tensors], shards).shard

    def measure(self, bench: TimeBench) -> FsdpTimes | None:
        """FSDP2 in place: each sampled unit (a block, the smallest unit) under ``fully_shard`` over every
        rank of the job, as a stage shards it, against a plain copy (see :func:`measure_units`)."""
        if bench.ranks < 2 or bench.layout != "sequential" or bench.mesh is None or not bench.samples:
            return None  # (the search tries FSDP2 on a split nn.Sequential only)
        return measure_units(bench)

    def time(self, ledger: TimeLedger) -> None:
        """Measured in place (:class:`FsdpTimes`, ``plan="auto"``): per FSDP2 unit of the rank's stages
        (each layer of a split Sequential, and each stage's root, with no parameters of its own), its
        all-gather and the end of its backward per batch, FSDP2's hooks and gradient accumulation on
        each micro-batch's forward and backward, its reduce-scatter per optimizer step, each a line in the
        unit's bytes. Else from the links: the all-gather of the rank's stages before the first forward,
        after the schedule one reduce-scatter per unit. HSDP adds an all-reduce of the shard over the
        replicas; the optimizer steps the shard."""
        plan, links = ledger.plan, ledger.links
        if plan.data_parallel != "fsdp":
            return
        shards, replicas = plan.layout().size("shard"), plan.data_parallel_size // plan.shard_size
        units = sum(len(c.units) + 1 for c in ledger.stages)
        grads = ledger.unreduced
        measured = ledger.times.measured.get(self.name) if ledger.times is not None else None
        if isinstance(measured, FsdpTimes):
            measured.charge(ledger, shards)
        else:
            nbytes = sum(ledger.facts.tensors[k].nbytes for k in ledger.keys)
            ledger.start += links.all_gather(shards, nbytes) + links.more_messages(shards, units)
            ledger.tail["communication"] += links.reduce_scatter(shards, grads) + links.more_messages(
                shards, units
            )
        ledger.tail["communication"] += links.all_reduce(replicas, grads / shards) + 2 * links.more_messages(
            replicas, units
        )
        ledger.unreduced = 0.0
        ledger.step_elements /= shards


TECHNIQUE = Fsdp()


@dataclass(frozen=True)
class FsdpTimes:
    """FSDP2 measured in place over ``shards`` ranks, per unit, as lines in its parameter bytes.

    ``gather``: the all-gather before the unit's first forward and the end of its backward, once per batch
    (each ``schedule.step()`` reshards); ``forward``/``backward``: what FSDP2 adds to the unit's own
    forward and backward on each micro-batch (its hooks; the unsharded gradients' accumulation);
    ``reduce``: the reduce-scatter of its gradients, once per optimizer step.

    Example::

        times = fsdp.measure_units(bench)       # on every rank of the job
        times.backward.at(800_000)              # seconds FSDP2 adds to a 800 KB block's backward
    """

    shards: int
    gather: Line
    forward: Line
    backward: Line
    reduce: Line

    def charge(self, ledger: TimeLedger, shards: int) -> None:
        """Add the rank's units' seconds to its ledger (collectives rescaled to ``shards`` as a ring moves
        bytes: ``(k - 1) / k`` of them)."""
        ring = (shards - 1) / shards / ((self.shards - 1) / self.shards)
        tensors, params = ledger.facts.tensors, ledger.facts.unit_params
        for c in ledger.stages:
            sizes = [sum(tensors[k].nbytes for k in params.get(n, [])) for n in c.units] + [0]  # + the root
            forward = sum(self.forward.at(b) for b in sizes)
            backward = sum(self.backward.at(b) for b in sizes)
            ledger.forward[c.index] += forward
            ledger.backward[c.index] += backward
            ledger.share(c.index, "communication", forward + backward)
            ledger.start += ring * sum(self.gather.at(b) for b in sizes)
            ledger.tail["communication"] += ring * sum(self.reduce.at(b) for b in sizes)


def measure_units(bench: TimeBench) -> FsdpTimes:
    """Each sampled unit sharded with ``fully_shard`` over the job's ranks (``reshard_after_forward=False``,
    gradient sync off, as a stage runs it) and a plain copy, on one micro-batch of the smallest size: the
    all-gather, the forward, the forward and backward, the end of the backward, the reduce-scatter; the
    differences from the plain copy, per unit, fitted as lines in the units' bytes.

    Example::

        FSDP_TIMES = measure_units(bench)     # every rank of the job calls it
    """
    mesh = bench.mesh((bench.ranks,), ("shard",))
    size = min(bench.sizes)
    points = []
    for sample in bench.samples:
        args, kwargs = bench.inputs(sample, size)
        plain = copy.deepcopy(sample.module).to(bench.device)
        sharded = copy.deepcopy(sample.module).to(bench.device)
        fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
        sharded.set_requires_gradient_sync(False)
        plain_forward = bench.timed(lambda m=plain, a=args, k=kwargs: m(*a, **k))
        plain_both = bench.timed(lambda m=plain, a=args, k=kwargs: _backward(m(*a, **k)))
        gather, forward, both, end, reduce = _sharded_step(sharded, args, kwargs, bench)
        extra_backward = (both - forward) - (plain_both - plain_forward)
        points.append((sample.nbytes, gather + end, forward - plain_forward, extra_backward, reduce))
        for p in sharded.parameters():
            p.grad = None
    return FsdpTimes(bench.ranks, *(Line.through((p[0], p[i]) for p in points) for i in range(1, 5)))


def _sharded_step(sharded: Any, args: Any, kwargs: Any, bench: TimeBench) -> tuple[float, ...]:
    """Median seconds of: the all-gather, a forward, a forward and backward, the end of that backward
    (gradients kept), the reduce-scatter; one micro-batch per repeat, as a schedule step runs it."""
    runs: list[list[float]] = []
    for repeat in range(bench.repeats + 1):
        marks: list[float] = []

        def mark(marks: list[float] = marks) -> None:
            bench.sync()
            if bench.device.type == "cuda":
                torch.cuda.synchronize(bench.device)
            marks.append(time.perf_counter())

        mark()
        sharded.unshard()
        mark()
        sharded(*args, **kwargs)
        mark()
        _backward(sharded(*args, **kwargs))
        mark()
        finish_backward(sharded, reduce=False)
        mark()
        finish_backward(sharded, reduce=True)
        mark()
        if repeat:
            runs.append([b - a for a, b in itertools.pairwise(marks)])
        sharded.reshard()
    return tuple(statistics.median(r[i] for r in runs) for i in range(5))


def _backward(out: Any) -> None:
    floats = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]
    sum(t.float().sum() for t in floats).backward()


class ReduceScatter(Reduction):
    """The FSDP2 roots' gradients reduce-scattered once per optimizer step (the whole window's), before
    the tied weights' replicas sum their shards.

    Example::

        ReduceScatter(roots)(finished=())
    """

    before_tied_sum = True

    def __init__(self, roots: Sequence[FSDPModule]) -> None:
        self.roots = list(roots)
        self.params = [p for root in self.roots for p in root.parameters()]

    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        reduce_gradients(self.roots)


def apply(stages: StageSource, plan: Any, mesh: Any, pin_memory: bool = False) -> list[nn.Module]:
    """Shard this rank's stages (the stage view's ``modules``) with FSDP2 when the plan says
    ``data_parallel="fsdp"`` (their shards on the host with ``offload="parameters"``, page-locked with
    ``pin_memory``): each stage module, or traced stages' one root (:func:`shard_traced`). The modules
    that are FSDP roots (also those a user's ``parallelize_fn`` made roots), whose gradients are then
    reduced once per optimizer step (:class:`DeferredReduceStage`).

    Raises:
        ValueError: FSDP2 without a process group (no device mesh).

    Example::

        roots = fsdp.apply(runner.stages, plan, mesh)
    """
    if plan.data_parallel == "fsdp" and mesh.device_mesh is None:
        raise ValueError(
            'data_parallel="fsdp" needs a process group (a device mesh) and there is none: run '
            'under a Trainer with the pipeline strategy, or use data_parallel="replicate"'
        )
    sharding = plan.data_parallel == "fsdp"
    # FSDP2's offload (offload="parameters"): the shards, their gradients and the optimizer state on the host.
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if sharding and "parameters" in plan.offload else None
    if sharding:
        quiet_view_output_warning()
    if sharding and stages.graphs:
        shard_traced(stages, mesh.data_parallel_mesh(), policy)
    elif sharding:
        for module in stages.modules:
            if not isinstance(module, FSDPModule):  # (a user-sharded one is left to it)
                shard_stage(module, mesh.data_parallel_mesh(), offload_policy=policy)
    roots = sharded_roots(stages.modules)
    if roots:
        stages.use_stage_class(DeferredReduceStage)
    return roots


def refuse_shared_on_one_rank(table: Any) -> None:
    """Refuse FSDP2 where one rank holds two stages that use one parameter (a tied weight).

    Every stage is its own FSDP2 root, and FSDP2 cannot shard one parameter in two roots: each root
    would put its own sharded copy in the tied weight's place, each taking only its stage's half of the
    gradient (their replicas across ranks are summed by ``grads/tied.py``, two copies on one rank are
    not), and the optimizer state of one copy would have no name in a checkpoint. Every rank reads the
    same stage table (``StagePlan``), so every rank refuses together.

    Raises:
        ValueError: naming the parameter, its stages and the rank, with the fixes.

    Example::

        refuse_shared_on_one_rank(job.table)   # a V schedule, a tied embedding and head: refused
    """
    users: dict[str, list[int]] = {}
    for index, stage in enumerate(table.stages):
        for name in stage.parameters:
            users.setdefault(name, []).append(index)
    for name, stages in sorted(users.items()):
        ranks = [table.pp_rank_of(s) for s in stages]
        twice = next((r for r in ranks if ranks.count(r) > 1), None)
        if twice is not None:
            held = [s for s, r in zip(stages, ranks) if r == twice]
            raise ValueError(
                f'data_parallel="fsdp" cannot shard {name!r}: stages {held} use it and pipeline rank '
                f"{twice} holds them all, and FSDP2 shards one parameter in one stage only (two sharded "
                f"copies would each take part of its gradient). Use a schedule that puts those stages on "
                f"different pipeline ranks (schedule='1f1b' or 'gpipe', or a looped schedule with "
                f"pipeline_size >= 2; not 'zbv' or 'dualpipev', nor pipeline_size=1 with stages_per_rank > "
                f"1), data_parallel='replicate' or 'zero1', or untie the weight"
            )


VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"
"""The start of the warning torch 2.13's FSDP2 gives for every forward whose output is a view."""


def quiet_view_output_warning() -> None:
    """Filter FSDP2's view-output warning (:data:`VIEW_OUTPUT_WARNING`) in this process: harmless here.

    FSDP2 warns at every forward whose output is a view, because an in-place op on that view would
    drop the pre-backward hook that all-gathers the parameters again for backward. An ``nn.Linear`` on
    a 3-D input returns a view (its matmul's output reshaped), so a language model's last stage warns
    twice on every rank that holds it (the head, and the stage module that returns its output) whether
    or not anything writes to it. Under this package the hook has nothing to do: the stages are sharded
    with ``reshard_after_forward=False``, so their parameters stay gathered from the first forward to
    the end of backward, and the end of each step's backward is driven by :class:`DeferredReduceStage`
    and :func:`reduce_gradients`, not by the hook. Training with in-place ops on the head's output
    equals one device (``tests/test_pipeline_fsdp.py``, the ``gpt-hsdp-1x2x2-inplace``
    run). The filter is the process's: it is set only where the package itself shards the stages
    (``data_parallel="fsdp"``), not for a module a user's ``parallelize_fn`` shards.

    Example::

        quiet_view_output_warning()   # before the stages first run forward; adding it again adds nothing
    """
    warnings.filterwarnings("ignore", message=VIEW_OUTPUT_WARNING, category=UserWarning)


def describe(mesh: Any) -> str:
    """The log line for sharded stages: over how many ranks, replicated how many times (HSDP)."""
    shards = mesh.size("shard")
    replicas = mesh.size("gradients") // shards
    hybrid = f", replicated {replicas} times (HSDP)" if replicas > 1 else ""
    return f"each stage sharded with FSDP2 over {shards} ranks{hybrid}"


def shard_stage(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = False,
    offload_policy: OffloadPolicy | None = None,
) -> FSDPModule:
    """``fully_shard`` each block of ``module`` (its children with parameters), then ``module`` itself.

    Children that share a parameter with another child are left to the root (FSDP2 cannot shard one
    parameter in two modules). A 2-D ``mesh`` (replicate, shard) gives HSDP. ``offload_policy``:
    FSDP2's ``CPUOffloadPolicy`` keeps the shards, their gradients and the optimizer state on the host.

    Example::

        shard_stage(stage_module, mesh.device_mesh["dp_shard"])
        isinstance(stage_module, FSDPModule)      # True; its parameters are DTensors
    """
    blocks = [c for c in module.children() if any(True for _ in c.parameters())]
    owners: dict[int, int] = {}
    for block in blocks:
        for p in block.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    kwargs["offload_policy"] = offload_policy or OffloadPolicy()
    for block in blocks:
        if all(owners[id(p)] == 1 for p in block.parameters()):
            fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module  # type: ignore[return-value]


def shard_traced(stages: StageSource, mesh: DeviceMesh, offload_policy: OffloadPolicy | None = None) -> None:
    """Shard the module holding this rank's traced stage as one FSDP2 root, in its place in the view's
    ``modules``; each stage then runs through the root, which is told before each schedule steps which
    graph it runs (that schedule's program: shapes differ).

    Example::

        shard_traced(runner.stages, mesh.data_parallel_mesh())
    """
    [held] = stages.modules  # (one stage per rank: refused otherwise before the split)
    root = shard_traced_stage(ShardedTracedStage(held), mesh, offload_policy)
    stages.modules[0] = root

    def run_through_root(stage: PreparedStage) -> None:
        runs = stage.module if stage.runs is None else stage.runs
        links = root.links(stage.module, stages.aliases)
        stage.runs, stage.activate = root, functools.partial(root.use_graph, runs, links)

    stages.each_stage(run_through_root)


# (the graph's slot dict, its name there, the root's slot dict, the name there)
_Link = tuple[dict[str, Any], str, dict[str, Any], str]


class ShardedTracedStage(nn.Module):
    """The FSDP root of one traced stage: holds the user's modules, runs the current export graph.

    Args:
        module: the user's module, pruned to this rank's stage; its children are held as they are
            (shared, so the user's module sees the sharded parameters FSDP puts in their place) and
            its own parameters are registered here too (and put back in it after sharding).

    Example::

        root = ShardedTracedStage(pruned_gpt)
        shard_traced_stage(root, mesh.device_mesh["dp_shard"])
        root.use_graph(stage_graph, root.links(stage_graph, aliases))   # this input shape's graph
        # (or what runs the graph: a tensor-parallel stage's wrapper, which runs it on DTensors)
        root(x)                                 # all-gathers the stage, runs the graph
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._owner = [module]  # a list: not registered as a submodule (it is the LightningModule)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, param in module._parameters.items():
            if param is not None:
                self.register_parameter(name, param)
        self._graph: nn.Module | None = None  # what runs the current graph (not a submodule)
        self._links: list[_Link] = []

    def links(self, graph: nn.Module, aliases: Mapping[str, str]) -> list[_Link]:
        """Where each parameter attribute of ``graph`` takes its tensor from in this root (by canonical
        name): computed once per graph, followed at every forward."""
        mine: dict[str, tuple[dict[str, Any], str]] = {}
        for path, _ in self.named_parameters(remove_duplicate=False):
            owner, _, leaf = path.rpartition(".")
            mine[aliases.get(path, path)] = (self.get_submodule(owner)._parameters, leaf)
        links = []
        for path, _ in graph.named_parameters(remove_duplicate=False):
            owner, _, leaf = path.rpartition(".")
            slot, name = mine[aliases.get(path, path)]
            links.append((graph.get_submodule(owner)._parameters, leaf, slot, name))
        return links

    def use_graph(self, runs: nn.Module, links: list[_Link]) -> None:
        """Run ``runs`` (a stage graph, or a module running it) from now on, the graph's parameter
        attributes following ``links`` (:meth:`links`)."""
        self.__dict__["_graph"], self._links = runs, links

    def forward(self, *args: Any) -> Any:
        if self._graph is None:
            raise RuntimeError("internal error: a sharded traced stage ran before use_graph")
        # FSDP's pre-forward has just set the unsharded parameters on the held modules.
        for graph_slot, graph_name, slot, name in self._links:
            graph_slot[graph_name] = slot[name]
        return self._graph(*args)

    def restore_owner_parameters(self) -> None:
        """Give the user's module the (sharded) parameters FSDP registered here in place of its own."""
        owner = self._owner[0]
        for name in list(owner._parameters):
            if name in self._parameters:
                owner._parameters[name] = self._parameters[name]


def shard_traced_stage(
    root: ShardedTracedStage, mesh: DeviceMesh, offload_policy: OffloadPolicy | None = None
) -> ShardedTracedStage:
    """``fully_shard`` the root over ``mesh`` (one unit per stage; see the module's docstring), with
    FSDP2's ``offload_policy`` (``CPUOffloadPolicy``: the shards on the host).

    Example::

        shard_traced_stage(ShardedTracedStage(pruned_module), mesh.data_parallel_mesh())
    """
    fully_shard(
        root, mesh=mesh, reshard_after_forward=False, offload_policy=offload_policy or OffloadPolicy()
    )
    root.restore_owner_parameters()
    return root


def sharded_roots(modules: Iterable[nn.Module]) -> list[FSDPModule]:
    """The stage modules that are FSDP roots (by this package or by a user's ``parallelize_fn``)."""
    return [m for m in modules if isinstance(m, FSDPModule)]


def reduce_gradients(roots: Iterable[FSDPModule]) -> None:
    """Reduce-scatter the gradients accumulated since the last call: once per optimizer step."""
    for root in roots:
        finish_backward(root, reduce=True)


def reshard(roots: Iterable[FSDPModule]) -> None:
    """Free the unsharded parameters (after a forward-only step; training steps reshard themselves).

    ``FSDPModule.reshard`` frees its own parameters only: every FSDP module under each root is asked.
    """
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


# torch workaround: https://github.com/pytorch/pytorch/pull/196641
#   canary: test_torch_schedules_keep_an_fsdp_module_s_gradient_sync_off
class DeferredReduceStage(PipelineStage):
    """A ``PipelineStage`` whose ``schedule.step()`` ends FSDP's backward without reducing gradients.

    torch 2.13 reduce-scatters at the end of every ``step()``; Lightning may accumulate several
    steps before the optimizer steps, so the reduction waits for :func:`reduce_gradients`.
    ``scale_grads`` stays the schedule's business (the strategy passes ``scale_grads=False``).
    """

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # Forward-only schedules call it too: nothing to end there (evaluation reshards by itself).
        if isinstance(self.submod, FSDPModule) and self.has_backward:
            finish_backward(self.submod, reduce=False)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


@dataclass(frozen=True)
class ShardedBytes:
    """What FSDP2 does to a stage's parameter bytes on one rank: its shard, and the whole stage gathered.

    Under a pipeline the stage is gathered once per step (``reshard_after_forward=False``) and stays
    gathered from its first forward to the end of the schedule; its unsharded gradients live until the
    one reduce-scatter before the optimizer step (so the gradient bytes do not shrink until then).
    """

    shard: int
    gathered: int


def state_bytes(tensors: Sequence[Any], shards: int) -> int:
    """The optimizer state of the fullest shard of each tensor (the planner's ``Tensor``: ``numel``,
    ``rows``, ``state``), per-tensor state such as Adam's ``step`` whole.

    Example::

        state_bytes([facts.tensors[k] for k in keys], 2)
    """
    out = 0
    for t in tensors:
        if t.state:
            out += t.state.of(
                round(t.numel * (shard_rows(t.rows, shards) / t.rows)) if shards > 1 else t.numel
            )
    return out


def memory(tensors: Sequence[tuple[int, int]], shards: int) -> ShardedBytes:
    """The memory effect of sharding tensors given as ``(rows of dim 0, bytes)`` over ``shards`` ranks.

    Example::

        >>> memory([(13, 13 * 8 * 4), (8, 8 * 4)], 2)
        ShardedBytes(shard=240, gathered=448)
    """
    shard = sum(round(nbytes * shard_rows(rows, shards) / rows) for rows, nbytes in tensors)
    return ShardedBytes(shard, sum(nbytes for _, nbytes in tensors))
