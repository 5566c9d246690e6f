"""Overlapped gradient reduction: the replicas' all-reduce started in buckets during the last backward.

The technique (:data:`TECHNIQUE`, ``overlap_gradient_reduction``, ``bucket_cap_mb``). Without it, the
replicas' all-reduce (``techniques/replicas.py``) runs once after the whole schedule, so every byte of it
is exposed at the end of every optimizer step. With it, as DDP's reducer and Megatron-LM's
``overlap_grad_reduce`` do, this rank's trainable parameters are grouped into buckets of about
``bucket_cap_mb`` megabytes (in reverse registration order, the order backward finishes them; one dtype
a bucket), and in the optimizer step's last accumulation batch a post-accumulate-grad hook counts each
parameter's gradient: once every parameter of a bucket has received its last micro-batch's gradient,
the bucket is copied into one flat buffer and its all-reduce starts (``async_op``; gloo runs it on its
own threads, NCCL on its own stream) while the backward of the earlier layers and the other
micro-batches' work go on. Buckets start strictly in order, on every replica alike, so the collectives
match. The optimizer step waits (:meth:`BucketedAverage.__call__`, the technique's reduction, run by
``grads/sync.py`` before clipping, the inf check and the step) and writes each bucket's mean back.

Exactness. Each bucket is summed, divided by the replicas and copied back exactly as
``all_reduce_coalesced`` does, and the same buckets are used whether the reduction overlaps or not
(off, or where a bucket did not start during backward, it is reduced at the wait, in the same layout):
on/off are bitwise equal for any number of replicas (gloo's ring may sum a different layout in another
order beyond two). A bucket starts only when its parameters' gradients are final: accumulation batches
before the last start nothing (the phase, :class:`~lightning_parallel.techniques.job.StepPhase`),
nor does a batch whose gradients are kept aside and added to earlier ones (``"keep"``: a hook reads
them), nor one where ``on_before_backward``/``on_after_backward`` may write the gradients (they are reduced
after those hooks, at the wait); a parameter that receives a gradient after its bucket started (not
expected: each micro-batch's backward accumulates once per parameter) makes the bucket reduce again at
the wait, from the gradient then there. Weight-gradient passes of the split-backward schedules
(``zbv``, ``dualpipev``, ``interleaved_zero_bubble``) assign ``.grad`` without the hook: their
buckets are reduced at the wait, exactly, not overlapped (a per-chunk start there is left to do).

What it leaves to the others: the tied weights (their replicas sum over the pipeline ranks first, then
the replicas' all-reduce averages the sum: ``replicas.py`` keeps them), FSDP2's stages (their own
reduce-scatter: the technique does nothing under ``data_parallel="fsdp"`` or where ``parallelize_fn``
made an FSDP root), a single replica (nothing to reduce).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.distributed.dtensors import local
from lightning_parallel.layout.choices import SPLIT_BACKWARD_SCHEDULES
from lightning_parallel.techniques.contract import Technique
from lightning_parallel.techniques.job import Job, Reduction, StepPhase
from lightning_parallel.techniques.ledgers import TimeLedger

MB = 1024 * 1024


class Overlap(Technique):
    """Overlapped gradient reduction (``overlap_gradient_reduction=True``, the default; ``bucket_cap_mb``).

    ``overlap_gradient_reduction=False`` reduces the same buckets after the schedule, one after another:
    the same numbers, bitwise. Turn it off to measure what the overlap hides (``experiments/
    bench_overlap.py``), or where a collective running beside the schedule costs more than it hides: a
    backend that serialises it with the pipeline's sends on one link, or a device short of the memory of
    the flat buckets in flight (one copy of the gradients at most, during the last backward).

    Example::

        PipelineStrategy(pipeline_size=2, bucket_cap_mb=50)       # overlapped, 50 MB buckets
        PipelineStrategy(pipeline_size=2, overlap_gradient_reduction=False)   # reduced after the schedule
    """

    name, fields = "overlap", ("overlap_gradient_reduction", "bucket_cap_mb")

    def normalized(self, plan: Any) -> dict[str, Any]:
        on, cap = plan.overlap_gradient_reduction, plan.bucket_cap_mb
        if not isinstance(on, bool):
            raise TypeError(
                f"overlap_gradient_reduction must be True (the replicas' all-reduce starts in buckets during "
                f"the last backward) or False (after the schedule), got {on!r}"
            )
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(
                f"bucket_cap_mb must be a positive number of megabytes (as DDP's, default 25), got {cap!r}"
            )
        return {"bucket_cap_mb": float(cap)}

    def step_context(self, job: Job) -> BucketedAverage | None:
        return buckets_of(job)

    def reductions(self, job: Job) -> list[Reduction]:
        average = buckets_of(job)
        return [average] if average is not None else []

    def time(self, ledger: TimeLedger) -> None:
        """Only the exposed part of the replicas' all-reduce, in the tail: the buckets run beside the last
        micro-batch's backward of the rank's stages (both slowed by the links' measured ``overlap``:
        :meth:`~lightning_parallel.planner.links.Links.overlapped`), but the last bucket, the first
        layers' gradients, starts when that backward ends. Where the reduction does not overlap (off,
        one replica, FSDP2's stages, the split-backward schedules' weight passes) it leaves the
        gradients to ``replicas.py``, which charges the whole all-reduce after the schedule."""
        plan = ledger.plan
        ranks = plan.layout().size("gradients")  # (the replicas x the sequence ranks, as replicas.py)
        split_backward = plan.schedule in SPLIT_BACKWARD_SCHEDULES
        if (
            not plan.overlap_gradient_reduction
            or ranks == 1
            or plan.data_parallel == "fsdp"
            or split_backward
        ):
            return
        if ledger.unreduced <= 0:
            return
        links, nbytes = ledger.links, ledger.unreduced
        last = links.all_reduce(ranks, min(nbytes, plan.bucket_cap_mb * MB))
        rest = links.all_reduce(ranks, nbytes) - last
        backward = sum(ledger.backward.values())  # (the last micro-batch's, on this rank's stages)
        hidden_beside = links.overlapped(backward, rest) - backward  # (what outlasts the backward)
        ledger.tail["communication"] += max(hidden_beside, 0.0) + last
        ledger.unreduced = 0.0


TECHNIQUE = Overlap()

_BY_MODULE: weakref.WeakKeyDictionary[nn.Module, tuple[Job, BucketedAverage | None]] = (
    weakref.WeakKeyDictionary()
)


def buckets_of(job: Job) -> BucketedAverage | None:
    """The job's bucketed reduction (one per job: the step context and the reduction are the same object),
    or None where the technique does nothing (one replica, FSDP2's stages)."""
    known = _BY_MODULE.get(job.module)
    if known is not None and known[0] is job:
        return known[1]
    if known is not None and known[1] is not None:
        known[1].remove_hooks()  # (an earlier job on the same module: its hooks go)
    average = _build(job)
    _BY_MODULE[job.module] = (job, average)
    return average


def _build(job: Job) -> BucketedAverage | None:
    plan, module = job.plan, job.module
    if plan.data_parallel == "fsdp" or job.mesh.size("gradients") == 1:
        return None
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return None  # (a parallelize_fn's FSDP root reduce-scatters its own)
    tied = set(job.tied)
    aliases = getattr(job.stages, "aliases", {}) or {}
    skipped = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if aliases.get(n, n) in tied}
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in skipped]
    buckets = bucket_layout(list(reversed(params)), int(plan.bucket_cap_mb * MB))
    if not buckets:
        return None
    group = job.mesh.group("gradients")
    return BucketedAverage(buckets, group, job.phase, overlap=plan.overlap_gradient_reduction)


def bucket_layout(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` (in the order backward finishes them) cut into buckets: consecutive parameters of one
    dtype, a bucket closed once it holds ``cap_bytes`` or more (a parameter is never split).

    Example::

        >>> ps = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float16), torch.zeros(8)]
        >>> [len(b) for b in bucket_layout(ps, cap_bytes=16)]
        [1, 1, 1, 1]
        >>> [len(b) for b in bucket_layout(ps, cap_bytes=1 << 20)]
        [2, 1, 1]
    """
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        shard = local(p)
        if not buckets or size >= cap_bytes or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += shard.numel() * shard.element_size()
    return buckets


class _Bucket:
    """One bucket's parameters and, once started, its flat buffer, its work and what was counted then."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.waiting = len(params)  # parameters whose last gradient has not come yet
        self.flat: torch.Tensor | None = None
        self.work: Any = None
        self.counted: list[int] = []
        self.times: list[int] = []  # perf_counter_ns when its all-reduce started, and when it completed
        self.timed: Any = None  # the future that notes the completion


class BucketedAverage(Reduction):
    """The gradients of ``buckets`` averaged over ``group``, bucket by bucket: started during the last
    backward where ``overlap`` (the step context arms the hooks), waited for when called.

    Args:
        buckets: the parameters, in buckets (:func:`bucket_layout`).
        group: the replicas of this rank's stages (``mesh.group("gradients")``).
        phase: what the schedule step about to run is (set by the strategy before each training batch).
        overlap: start each bucket when final (else: every bucket at the wait).

    Example::

        average = BucketedAverage(bucket_layout(params, 25 << 20), group, phase)
        with average:                 # around the schedule step (the runner's step context)
            schedule.step(...)        # the last micro-batch's backward starts the buckets
        average(finished=())          # the optimizer step: wait, and the means written back
    """

    before_tied_sum = False

    def __init__(
        self, buckets: list[list[torch.Tensor]], group: Any, phase: StepPhase, overlap: bool = True
    ) -> None:
        self.buckets = [_Bucket(b) for b in buckets]
        self.params = tuple(p for b in buckets for p in b)
        self.group, self.phase, self.overlap = group, phase, overlap
        self.size = dist.get_world_size(group)
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self._count = dict.fromkeys(self._bucket_of, 0)
        self._expected = 0  # micro-batches whose gradient a parameter receives in the armed batch
        self._next = 0  # the next bucket to start: they start in order, on every replica alike
        self.in_flight = 0  # buckets started during this step's backward, not waited for yet
        self.started = 0  # buckets the last optimizer step found started during its backward (tests, bench)
        self.spans: list[tuple[str, int, int]] = []  # those buckets' all-reduces (the timeline draws them)
        self._hooks = (
            [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params] if overlap else []
        )

    # --- the step context: armed in the optimizer step's last accumulation batch
    def __enter__(self) -> BucketedAverage:
        if self.overlap and self.phase.reduces:
            self._arm(self.phase.microbatches)
        return self

    def __exit__(self, *exc: object) -> None:
        self._expected = 0  # (a hook outside the training schedule counts nothing)

    def _arm(self, microbatches: int) -> None:
        self._drain()  # (an earlier step whose optimizer step never waited: its buckets are dropped)
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
        self._count = dict.fromkeys(self._count, 0)
        self._expected, self._next, self.in_flight = microbatches, 0, 0

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._expected == 0:
            return
        key = id(p)
        self._count[key] += 1
        if self._count[key] != self._expected:
            return
        index = self._bucket_of[key]
        self.buckets[index].waiting -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        bucket.flat = _flatten_dense_tensors([local(p.grad) for p in bucket.params])
        bucket.counted = [self._count[id(p)] for p in bucket.params]
        bucket.times = [time.perf_counter_ns()]
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        times = bucket.times  # (completed on the backend's thread: the span's true end, not the wait's)
        bucket.timed = bucket.work.get_future().then(lambda _: times.append(time.perf_counter_ns()))
        self.in_flight += 1

    # --- the reduction: the optimizer step waits here, before it reads the gradients
    def __call__(self, finished: Collection[torch.Tensor]) -> None:
        self.spans = []
        for index, bucket in enumerate(self.buckets):
            timed, bucket.timed = bucket.timed, None
            self._finish(bucket)
            if timed is not None:
                timed.wait()
                self.spans.append((f"all-reduce bucket {index}", *bucket.times))
        self._expected, self._next, self.started, self.in_flight = 0, 0, self.in_flight, 0

    def _finish(self, bucket: _Bucket) -> None:
        flat, work = bucket.flat, bucket.work
        bucket.flat, bucket.work = None, None
        if work is not None:
            work.wait()
            counted = [self._count[id(p)] for p in bucket.params]
            if bucket.counted != counted or any(p.grad is None for p in bucket.params):
                flat = None  # (a gradient came after the bucket started: reduced again from what is there)
        params = bucket.params if flat is not None else [p for p in bucket.params if p.grad is not None]
        if not params:
            return
        grads = [local(p.grad) for p in params]
        if flat is None:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.group)
        flat.div_(self.size)  # (as all_reduce_coalesced: the sum, then the mean)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    def _drain(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.flat, bucket.work, bucket.timed = None, None, None
        self.in_flight = 0

    def remove_hooks(self) -> None:
        """Detach the hooks (a later job on the same module builds its own)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
