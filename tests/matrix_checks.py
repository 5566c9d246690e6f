"""Each technique's own check in the configuration matrix (tests/matrix.py), beside losses and parameters.

A :class:`Check` says what every rank records around and after a case's fit (``context``, ``record``)
and what the test then asserts over the ranks' records (``verify``, which returns the problems, in
words). ``test_matrix.py`` runs the check of every technique a case runs (``Case.active()``); a new
technique adds its check to :data:`CHECKS` (or none: losses and parameters against one device are every
case's check).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.callbacks import Callback
from matrix import CALLS, GLOBAL_BATCH, MICROBATCHES, MODELS, SAMPLES, Case

from lightning_parallel.distributed.dtensors import local
from lightning_parallel.optim.sharded import is_sharded, local_state_bytes
from lightning_parallel.techniques.fsdp import sharding as fsdp_sharding
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.disk_optimizer import DiskStepping
from lightning_parallel.techniques.offload.host_optimizer import is_host_stepping
from lightning_parallel.techniques.overlap import BucketedAverage
from lightning_parallel.techniques.recompute import is_checkpointed
from lightning_parallel.techniques.zero import shard_owners

Records = list[dict[str, Any]]


class Check:
    """One technique's check: every member optional."""

    @contextlib.contextmanager
    def context(self, case: Case, out: dict[str, Any]) -> Iterator[None]:
        """Around the fit on every rank; what it saw goes into ``out``."""
        yield

    def callback(self, case: Case, out: dict[str, Any]) -> Any:
        """A Lightning callback for the fit (what only a hook sees), or None; it writes into ``out``."""
        return None

    def record(self, trainer: Any, module: Any, case: Case) -> dict[str, Any]:
        """After the fit, on every rank (every rank calls it: it may run a collective)."""
        return {}

    def verify(self, case: Case, records: Records, reference: dict[str, Any]) -> list[str]:
        """The problems the ranks' records show ([] when none)."""
        return []


def _stages_here(case: Case) -> int:
    return case.shape.stages_per_rank


class Recompute(Check):
    """Every unit is recomputed: each layer of the Sequential, each block a traced stage calls (wrapped
    when the stage is prepared, at its first step: spied on)."""

    def callback(self, case, out):
        return _SpyWrappedUnits(out) if MODELS[case.model].traced else None

    def record(self, trainer, module, case):
        if MODELS[case.model].traced:
            return {}
        return {"checkpointed": sorted(n for n, m in module.named_modules() if is_checkpointed(m))}

    def verify(self, case, records, reference):
        spec = MODELS[case.model]
        want = {f"{'h' if spec.traced else 'layers'}.{i}" for i in range(spec.units)}
        seen = {n for r in records for n in r["checkpointed"]}
        return [] if want <= seen else [f"units not recomputed: {sorted(want - seen)} (seen {sorted(seen)})"]


class _SpyWrappedUnits(Callback):
    """The traced stages' units this rank wrapped (its stage modules are built at the first step)."""

    def __init__(self, out: dict[str, Any]) -> None:
        self.out = out
        out["checkpointed"] = []

    def on_train_start(self, trainer, pl_module) -> None:
        wrapped = self.out["checkpointed"]

        def spy(stage):  # called after recomputation's own wrap, on each stage now or as it is prepared
            wrapped.extend(n for n, m in stage.units if is_checkpointed(m) and n not in wrapped)

        trainer.strategy.parts.runner.stages.each_stage(spy)


COLWISE = re.compile(r"attn\.[qkv]\.weight$|mlp\.fc\.(weight|bias)$")
ROWWISE = re.compile(r"attn\.proj\.weight$|mlp\.proj\.weight$")


class TensorParallel(Check):
    """The split layers are DTensors sharded over the tensor-parallel ranks: q, k, v and the MLP's first
    projection by rows, the output projections by columns (the last mesh dimension is tensor parallel)."""

    def verify(self, case, records, reference):
        problems = []
        for rank, r in enumerate(records):
            for name, (kind, placements, _) in r["held"].items():
                want = (
                    "Shard(dim=0)"
                    if COLWISE.search(name)
                    else "Shard(dim=1)"
                    if ROWWISE.search(name)
                    else None
                )
                last = (re.findall(r"\w+\([^()]*\)", placements) or [""])[-1]
                if want and (kind != "DTensor" or last != want):
                    problems.append(f"rank {rank}: {name} is held as {kind} {placements}, not split ({want})")
        seen = {n for r in records for n in r["held"] if COLWISE.search(n) or ROWWISE.search(n)}
        return problems + ([] if seen else ["no split layer held on any rank"])


class UserFunction(Check):
    """The ``parallelize_fn`` ran once on each of this rank's stages, with the job's whole mesh."""

    def record(self, trainer, module, case):
        calls, CALLS[:] = list(CALLS), []
        return {"calls": calls}

    @contextlib.contextmanager
    def context(self, case, out):
        CALLS.clear()
        yield

    def verify(self, case, records, reference):
        mesh = tuple(case.plan.layout().mesh_shape)
        want = [mesh] * _stages_here(case)
        return [f"rank {i}: parallelize_fn saw {r['calls']}, not {want}" for i, r in enumerate(records)
                if [shape for _, shape in r["calls"]] != want]  # fmt: skip


class Compile(Check):
    """The stages ran compiled (the compilation's seconds are counted: on the ranks whose stages hold the
    model's repeated block), and still equal one device."""

    def callback(self, case, out):
        return _CompileSeconds(out)

    def verify(self, case, records, reference):
        seconds = [r["compile_seconds"] for r in records]  # (a stage without the repeated block has none)
        return [] if any(s > 0 for s in seconds) else [f"no rank compiled anything: {seconds} seconds"]


class _CompileSeconds(Callback):
    """The strategy's compile seconds when training ends (its watch stops with the fit)."""

    def __init__(self, out: dict[str, Any]) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        self.out["compile_seconds"] = trainer.strategy.compile_seconds


class Fsdp(Check):
    """FSDP2 reduce-scatters once per optimizer step (never per batch or micro-batch), every stage
    parameter is a DTensor, the stage table's bytes per rank are what each rank holds, and FSDP2's
    warning about an output view is filtered where the package shards."""

    @contextlib.contextmanager
    def context(self, case, out):
        calls, original = [], fsdp_sharding.finish_backward

        def spy(root, reduce):
            calls.append(reduce)
            original(root, reduce)

        fsdp_sharding.finish_backward = spy
        try:
            with warnings.catch_warnings(record=True) as shown:
                warnings.simplefilter("always")
                yield
        finally:
            fsdp_sharding.finish_backward = original
        out["reductions"] = calls
        out["views"] = [
            str(w.message) for w in shown if re.match(fsdp_sharding.VIEW_OUTPUT_WARNING, str(w.message))
        ]

    def record(self, trainer, module, case):
        held = sum(local(p).untyped_storage().nbytes() for p in module.parameters())
        table = [s.bytes_per_rank for s in trainer.strategy.plan.stages if trainer.global_rank in s.ranks]
        return {"bytes": (held, sum(table))}

    def verify(self, case, records, reference):
        v = _stages_here(case)
        # a batch: each stage ends its backward without reducing; a window's last: then one reduce each
        want = [False] * v + [False] * v + [True] * v + [False] * v + [True] * v  # (one epoch: 3 batches)
        problems = [f"rank {i}: reductions {r['reductions']}, not {want}" for i, r in enumerate(records)
                    if r["reductions"] != want]  # fmt: skip
        problems += [f"rank {i}: FSDP2's view warning shown: {r['views'][:1]}" for i, r in enumerate(records)
                     if r["views"]]  # fmt: skip
        # (with tensor parallelism the table's column is the FSDP2 shard of the unsplit layers: 14172
        # bytes where a rank of the Sequential GPT at dp 2 x tp 2 holds 7900; a finding, not checked)
        if case.plan.tensor_parallel_size == 1:
            problems += [f"rank {i}: holds {r['bytes'][0]} bytes, the stage table says {r['bytes'][1]}"
                         for i, r in enumerate(records) if r["bytes"][0] != r["bytes"][1]]  # fmt: skip
        problems += [f"rank {i}: {n} held as {kind}" for i, r in enumerate(records)
                     for n, (kind, _, _) in r["held"].items() if kind != "DTensor"]  # fmt: skip
        return problems


class Zero(Check):
    """ZeRO-1 shards the optimizer state: the replicas of a stage hold it once between them (the bytes one
    device's optimizer holds for the parameters the stage steps), each the share torch's rule gives it
    (``techniques/zero.py: shard_owners``, the memory planner's model: whole tensors, largest first)."""

    def record(self, trainer, module, case):
        optimizer = trainer.optimizers[0]
        named = {p: n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        groups = [[(named[p], p.numel()) for p in g["params"]] for g in optimizer.param_groups]
        return {
            "sharded": is_sharded(optimizer),
            "state_bytes": local_state_bytes(optimizer),
            "groups": groups,
        }

    def verify(self, case, records, reference):
        if "optimizer" in case.plan.offload:  # (the host step shards its own state: the offload check)
            return []
        problems = [f"rank {i}: optimizer not sharded" for i, r in enumerate(records) if not r["sharded"]]
        stages: dict[int, list[dict]] = {}
        for r in records:
            stages.setdefault(r["pp_rank"], []).append(r)
        state = reference["state_bytes"]
        for pp_rank, replicas in stages.items():
            groups = replicas[0]["groups"]
            owners = shard_owners([[numel for _, numel in g] for g in groups], len(replicas))
            want = [0] * len(replicas)
            for group, group_owners in zip(groups, owners):
                for (name, _), owner in zip(group, group_owners):
                    want[owner] += state[name]
            held = [r["state_bytes"] for r in replicas]
            if held != want:
                problems.append(
                    f"pipeline rank {pp_rank}: replicas hold {held} bytes, torch's rule gives {want}"
                )
        return problems


class Offload(Check):
    """What the plan offloads is on the host: the optimizer's state (and its step) for the replicas,
    ZeRO-1 and FSDP2's device shards (in files with ``offload_to="disk"``), FSDP2's shards for
    "parameters"; frozen parameters get neither state nor a host copy; what a
    rank keeps for backward sat on the host, as many micro-batches at once as the schedule keeps in
    flight, none once each step's backwards ran."""

    def record(self, trainer, module, case):
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1's shard
        contexts = trainer.strategy.parts.runner.step_contexts
        hooks = next((c for c in contexts if isinstance(c, ActivationOffload)), None)
        frozen = {p for p in module.parameters() if not p.requires_grad}
        copies = [c for g in getattr(inner, "_copies", []) for c in g if c is not None]
        return {
            "host_stepping": is_host_stepping(optimizer),
            "on_disk": isinstance(inner, DiskStepping),
            "frozen_with_state": sum(p in frozen for p in inner.state),
            "frozen_with_copy": sum(c.device in frozen for c in copies),
            "state_devices": sorted({str(v.device) for s in inner.state.values() for v in s.values()}),
            "activations": None
            if hooks is None
            else (hooks.packed_bytes, hooks.peak_bytes, hooks.live_bytes),
        }

    def verify(self, case, records, reference):
        plan, problems = case.plan, []
        disk = plan.offload_to == "disk"  # (the disk tier streams the state: no host-stepping copy)
        host_step = "optimizer" in plan.offload and "parameters" not in plan.offload and not disk
        for i, r in enumerate(records):
            if r["frozen_with_state"] or r["frozen_with_copy"]:
                problems.append(f"rank {i}: frozen parameters with state or a host copy")
            if r["host_stepping"] != host_step:
                problems.append(f"rank {i}: host stepping {r['host_stepping']}, the plan says {host_step}")
            if r["on_disk"] != disk:
                problems.append(f"rank {i}: state on the disk {r['on_disk']}, offload_to {plan.offload_to}")
            if r["state_devices"] not in ([], ["cpu"]):
                problems.append(f"rank {i}: optimizer state on {r['state_devices']}")
            if (r["activations"] is not None) != ("activations" in plan.offload):
                problems.append(f"rank {i}: activation hooks {r['activations']}, offload {plan.offload}")
        if "activations" in plan.offload:
            problems += _in_flight(case, records)
        return problems


def _in_flight(case: Case, records: Records) -> list[str]:
    """Each rank's peak of activations on the host: (p - its pipeline rank) full micro-batches under
    1F1B, at least two under the schedules that keep several stages' in flight; nothing left after."""
    plan, problems = case.plan, []
    replicas = plan.data_parallel_size
    samples = SAMPLES // replicas  # (each case trains one epoch)
    microbatch = GLOBAL_BATCH // replicas // MICROBATCHES
    if not any(r["activations"][0] for r in records):
        problems.append("no rank moved activations to the host")
    for i, r in enumerate(records):
        packed, peak, live = r["activations"]
        if live:
            problems.append(f"rank {i}: {live} bytes of activations left on the host")
        if not packed:  # (a V stage of one recomputed layer keeps only its received input)
            continue
        per_sample = packed / samples / case.shape.stages_per_rank  # (per stage: the MLP's grow exactly)
        slack = 1e-6 if case.model == "mlp" else 0.02  # (a GPT's also hold a few per micro-batch)
        if plan.pipeline_size == 1:
            continue
        if case.shape.stages_per_rank == 1 and plan.schedule == "1f1b":
            want = (plan.pipeline_size - r["pp_rank"]) * microbatch * per_sample
            if abs(peak - want) > slack * want:
                problems.append(f"rank {i}: peak {peak} bytes on the host, 1F1B keeps {want}")
        elif peak < 2 * microbatch * per_sample * (1 - slack) and case.shape.stages_per_rank > 1:
            problems.append(f"rank {i}: peak {peak} bytes, less than two micro-batches in flight")
    return problems


SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")
"""The schedules whose weight-gradient passes assign ``.grad`` without the post-accumulate-grad hook."""


class Overlap(Check):
    """The replicas' all-reduce overlapped with the last backward (on by default): in every optimizer
    step every bucket of every rank started during the backward (under the schedules whose backward
    accumulates the gradients: not the split-backward ones, reduced at the wait); switched off, none did.
    The numbers are every case's check (against one device); bitwise on/off in test_pipeline_idioms.py."""

    def callback(self, case, out):
        return _BucketsStarted(out)

    def verify(self, case, records, reference):
        on, problems = case.plan.overlap_gradient_reduction, []
        for i, r in enumerate(records):
            buckets, started = r["buckets"], r["started"]
            if not buckets or not started:
                problems.append(f"rank {i}: no bucketed reduction ({buckets} buckets, steps {started})")
            elif not on and any(started):
                problems.append(f"rank {i}: switched off, yet buckets started during backward: {started}")
            elif on and case.plan.schedule not in SPLIT_BACKWARD and set(started) != {buckets}:
                problems.append(f"rank {i}: buckets started per step {started}, of {buckets}")
        return problems


class _BucketsStarted(Callback):
    """After each optimizer step's gradient sync: how many buckets its last backward started."""

    def __init__(self, out: dict[str, Any]) -> None:
        self.out = out
        out["buckets"], out["started"] = 0, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for reduction in trainer.strategy._sync.reductions:
            if isinstance(reduction, BucketedAverage):
                self.out["buckets"] = len(reduction.buckets)
                self.out["started"].append(reduction.started)


CHECKS: dict[str, Check] = {
    "recompute": Recompute(),
    "tensor_parallel": TensorParallel(),
    "user_function": UserFunction(),
    "compile": Compile(),
    "fsdp": Fsdp(),
    "zero": Zero(),
    "overlap": Overlap(),
    "offload": Offload(),
}
"""Per technique (by name), its check; a technique without one is checked by losses and parameters."""
