"""Offload as a technique (``offload=``, ``offload_pin_memory``, ``offload_to``, ``offload_dir``,
``offload_buffer``): its settings checked, its refusals, its label and variants, what the job needs (a
host backend, parameters left on the host), and its transforms.

* the optimizers, right after ``configure_optimizers`` (:meth:`Offload.optimizers`). Plain replicas and
  ZeRO-1: each is rebuilt as the user's class made host-stepping (``host_optimizer.py``): it keeps the
  user's param groups (the device parameters, which clipping, loss scaling and LR schedulers read and
  write) and steps a copy of itself over host copies of the trainable parameters; the gradients reach
  the host once per optimizer step, the updated parameters return once. ZeRO-1 builds its shard's
  optimizer from that class. FSDP2 stages with ``offload="optimizer"``: the shards stay on the device,
  the optimizer is rebuilt host-stepping over them (``shard_optimizer.py``). FSDP2 stages with
  ``offload="parameters"``: the user's optimizer holds FSDP2's host shards already (FSDP2 reads
  ``plan.offload`` itself); its step runs the fastest host kernel. ``offload_to="disk"``: whichever the
  mode, the optimizer is rebuilt with its state in files under ``offload_dir`` (``disk_optimizer.py``),
  closed (its files removed) when the run ends (:meth:`Offload.teardown`);
* each training step (:meth:`Offload.step_context`): the saved activations on the host
  (``activations.py``).

For the planner: what it moves from a rank's device to its host (:meth:`Offload.memory`, with
``memory.py``'s arithmetic) and the copies and the host step it adds to a step (:meth:`Offload.time`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from lightning_parallel._options import unknown_option_error
from lightning_parallel.techniques.contract import (
    Environment,
    Job,
    MemoryLedger,
    SearchOptions,
    Technique,
    TimeBench,
    TimeLedger,
)
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.checks import (
    buffer_bytes,
    check_disk,
    check_offload,
    checked_offload,
)
from lightning_parallel.techniques.offload.disk_optimizer import DiskStepping, DiskTier, disk_step
from lightning_parallel.techniques.offload.disk_plan import disk_seconds, state_to_disk
from lightning_parallel.techniques.offload.host_optimizer import host_step, use_host_kernels
from lightning_parallel.techniques.offload.memory import memory
from lightning_parallel.techniques.offload.search_options import (
    OFFLOAD,
    OFFLOAD_DIR,
    OFFLOAD_PARAMETERS,
    SEARCH_OPTIONS,
)
from lightning_parallel.techniques.offload.shard_optimizer import host_step_shards
from lightning_parallel.techniques.offload.timing import ActivationTimes, measure_activations

SHORT = {"optimizer": "opt", "parameters": "param", "activations": "act"}
"""Each target's name in a plan's label."""

OFFLOAD_TO = ("host", "disk")
"""Where ``offload="optimizer"`` keeps the state: host memory, or files under ``offload_dir``."""

DEFAULT_BUFFER = 2**30
"""The disk tier's host buffer per rank and optimizer when ``offload_buffer`` is not given."""


class Offload(Technique):
    """``offload=``: the optimizer state and its step, FSDP2's shards, or the saved activations, on the host.

    Example::

        ParallelPlan(devices=2, pipeline_size=2, offload="optimizer").label()
        # 'pp 2x1 1f1b m=4 +offload opt'
    """

    name, searched = "offload", ("offload",)
    fields = ("offload", "offload_pin_memory", "offload_to", "offload_dir", "offload_buffer")
    search_options = SEARCH_OPTIONS

    def normalized(self, plan: Any) -> dict[str, Any]:
        if plan.offload_pin_memory is not None and not isinstance(plan.offload_pin_memory, bool):
            raise TypeError(
                f"offload_pin_memory must be True, False or None, got {plan.offload_pin_memory!r}"
            )
        if plan.offload_to not in OFFLOAD_TO:
            raise unknown_option_error("PipelineStrategy(offload_to=...)", str(plan.offload_to), OFFLOAD_TO)
        buffer = plan.offload_buffer
        return {
            "offload": checked_offload(plan.offload, plan.data_parallel),
            "offload_buffer": None if buffer is None else buffer_bytes(buffer),
        }

    def check(self, plan: Any) -> None:
        if plan.offload and plan.strategy != "pipeline":
            raise ValueError(
                f"offload runs under PipelineStrategy, but strategy={plan.strategy!r}: use "
                f"strategy='pipeline' (pipeline_size=1 for one device or pure data parallelism)"
            )
        check_offload(plan.offload, plan.tensor_parallel_size, plan.parallelize_fn)
        check_disk(plan.offload, plan.offload_to, plan.offload_dir, plan.offload_buffer)

    def label(self, plan: Any) -> str:
        if not plan.offload:
            return ""
        shown = [SHORT[t] for t in plan.offload if t != "optimizer" or "parameters" not in plan.offload]
        return f" +offload {','.join(shown)}" + (" on disk" if plan.offload_to == "disk" else "")

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        yield {}
        if not search.asks(OFFLOAD) or plan.offload:
            return
        yield {"offload": ("optimizer",)}  # (replicas, ZeRO-1 and FSDP2: the state and its step)
        directory = search.asks(OFFLOAD_DIR)
        if directory:  # (the disk tier: the state in files; kept where the host cannot hold it)
            yield {"offload": ("optimizer",), "offload_to": "disk", "offload_dir": directory}
        if search.asks(OFFLOAD_PARAMETERS):
            yield {"offload": ("parameters",)}  # (FSDP2)
        if not plan.activation_checkpointing:  # (recomputed: little left to move)
            yield {"offload": ("activations",)}

    def environment(self, plan: Any, env: Environment) -> None:
        if not plan.offload:
            return
        if plan.offload_pin_memory and env.device.type == "cpu":
            raise ValueError(
                "offload_pin_memory=True page-locks the host copies so an accelerator copies them "
                "asynchronously, but the stages run on the CPU (accelerator='cpu'; a CPU-only torch build "
                "cannot pin memory at all): drop offload_pin_memory (by default it pins on an accelerator "
                "only)"
            )
        if "parameters" in plan.offload:
            env.host_backend = (
                "offload='parameters' keeps FSDP2's shards and gradients on the host, where clipping "
                "reduces their norm and a checkpoint gathers them"
            )
            env.parameters_on_host = True
        elif "optimizer" in plan.offload and plan.data_parallel == "fsdp":
            env.host_backend = (
                "offload='optimizer' with data_parallel='fsdp' keeps the shards' optimizer state on the "
                "host as DTensors, which a consolidated checkpoint gathers"
            )

    def optimizers(self, optimizers: list[torch.optim.Optimizer], job: Job) -> list[torch.optim.Optimizer]:
        if not job.plan.offload:
            return optimizers
        plan = job.plan
        where = f"in files under {plan.offload_dir}" if plan.offload_to == "disk" else None
        job.info(f"PipelineStrategy: {describe(plan.offload, job.pin_memory, where)}")
        return apply(optimizers, job.schedulers, plan, job.mesh.group("optimizer_shard"), job.pin_memory)

    def teardown(self, optimizers: list[torch.optim.Optimizer], job: Job, interrupted: bool = False) -> None:
        """The disk tier's files removed (its threads stopped, its buffers freed) when the run ends,
        normally or by a stop; a killed run's are removed by the kernel or by the next run. After a
        normal end the state is read into host tensors first (``DiskStepping.close(keep_state=True)``):
        a checkpoint saved after ``fit`` holds it, as without the tier."""
        for optimizer in optimizers:
            inner = getattr(optimizer, "optim", optimizer)  # (ZeRO-1's shard)
            if isinstance(inner, DiskStepping):
                inner.close(keep_state=not interrupted)

    def step_context(self, job: Job) -> ActivationOffload | None:
        return ActivationOffload(job.pin_memory) if "activations" in job.plan.offload else None

    def memory(self, ledger: MemoryLedger) -> None:
        """The parameter and optimizer bytes moved off the rank's device, and the host's bytes (``memory.py``,
        as the techniques before it left them: FSDP2's shards, ZeRO-1's share of the state; with
        ``offload_to="disk"`` the state in the disk column, the host holding the buffer); with
        ``"activations"``, the stages as the device sees them (a micro-batch's saved tensors only during
        its backward, a transient) and the host's bytes (each stage's micro-batches in flight at their
        most)."""
        offload = ledger.plan.offload
        hosted = tuple(t for t in offload if t != "activations")
        if hosted:
            _state_to_host(ledger, hosted)
        if "activations" in offload:
            stages = ledger.stages
            ledger.add_host(
                "activations", sum(c.per_microbatch * ledger.in_flight.get(c.index, 0) for c in stages)
            )
            ledger.stages = [
                dataclasses.replace(
                    c, per_microbatch=0, backward_transient=c.backward_transient + c.per_microbatch
                )
                for c in stages
            ]

    def measure(self, bench: TimeBench) -> ActivationTimes | None:
        """Offloaded activations in place: the bench's block under the saved-tensor hooks against the same
        block without them (:func:`~.timing.measure_activations`)."""
        return measure_activations(bench) if bench.samples else None

    def time(self, ledger: TimeLedger) -> None:
        """Offloaded activations: their copy to the host in forward and back in backward (measured in
        place under ``plan="auto"``, :class:`~.timing.ActivationTimes`: the hooks' cost per tensor too).
        FSDP2's shards: their copy up before the all-gather, the gradients' down after the
        reduce-scatter. The optimizer state: the gradients to the host and the parameters back. Either way
        the optimizer steps on the host (its extra over the device's step charged to offload);
        ``offload_to="disk"``: its files read and written at the links' disk bandwidth beside it
        (``disk_plan.py``)."""
        offload, links = ledger.plan.offload, ledger.links
        if "activations" in offload:
            measured = ledger.times.measured.get(self.name) if ledger.times is not None else None
            for c in ledger.stages:
                if isinstance(measured, ActivationTimes):  # (the hooks' own cost per tensor included)
                    out, back = measured.seconds(c.per_microbatch, ledger.micro_batch)
                else:
                    out = back = links.copy(c.per_microbatch)
                ledger.forward[c.index] += out
                ledger.backward[c.index] += back
                ledger.share(c.index, "offload", out + back)
        trainable = [ledger.facts.tensors[k] for k in ledger.keys if ledger.facts.tensors[k].grad]
        grads = ledger.gradients
        if "parameters" in offload:
            shards = ledger.plan.layout().size("shard")  # (FSDP2's: the sequence ranks join it)
            nbytes = sum(ledger.facts.tensors[k].nbytes for k in ledger.keys)
            ledger.start += links.copy(nbytes / shards)
            ledger.tail["offload"] += links.copy(grads / shards)
        elif "optimizer" in offload:
            ledger.tail["offload"] += links.copy(grads) + links.copy(sum(t.nbytes for t in trainable))
        if "optimizer" in offload:  # (FSDP2's offload of the shards implies it)
            times, elements, tensors = ledger.times, ledger.step_elements, ledger.step_tensors
            step = times.host_step.of(elements, tensors)
            ledger.tail["offload"] += max(0.0, step - times.step.of(elements, tensors))
            ledger.tail["optimizer"] = step
            if ledger.plan.offload_to == "disk":
                buffer = buffer_bytes(ledger.plan.offload_buffer or DEFAULT_BUFFER)
                ledger.tail["offload"] += disk_seconds(ledger, step, buffer)


TECHNIQUE = Offload()


def _state_to_host(ledger: MemoryLedger, hosted: tuple[str, ...]) -> None:
    """The parameters (FSDP2's shards) and the optimizer state off the device, the host's bytes on it;
    ``offload_to="disk"``: the state on the disk instead (``disk_plan.py``)."""
    device, tensors = ledger.device, [ledger.facts.tensors[k] for k in ledger.keys]
    if ledger.plan.offload_to == "disk":
        buffer = buffer_bytes(ledger.plan.offload_buffer or DEFAULT_BUFFER)
        state_to_disk(ledger, [t for t in tensors if t.grad], buffer)
        return
    trainable = sum(t.nbytes for t in tensors if t.grad)
    p_bytes, state = device["parameters"], device["optimizer"]
    if "parameters" in hosted:  # FSDP2's CPUOffloadPolicy: p_bytes and state are the rank's shards
        placed = memory(hosted, parameters=p_bytes, gradients=ledger.reduced_gradients, optimizer=state,
                        trainable=trainable, activations=0, in_flight=0)  # fmt: skip
        device["parameters"] -= p_bytes
    else:
        whole = ledger.whole["optimizer"]
        share = round(trainable * state / whole) if whole else trainable  # ZeRO-1 steps its shard
        placed = memory(hosted, parameters=p_bytes, gradients=ledger.reduced_gradients, optimizer=state,
                        trainable=share, activations=0, in_flight=0)  # fmt: skip
    device["optimizer"] -= state
    ledger.add_host("parameters" if "parameters" in hosted else "optimizer", placed.host)


def describe(offload: Sequence[str], pin_memory: bool, state_where: str | None = None) -> str:
    """What is on the host, in words (the log's line); ``state_where``: where the optimizer state is
    kept instead (the disk tier's files).

    Example::

        >>> describe(("optimizer",), False)
        'on the host (not pinned): the optimizer state and its step'
        >>> describe(("optimizer",), False, "in files under /nvme")
        'on the host (not pinned): the optimizer state (in files under /nvme) and its step'
    """
    what = {
        "parameters": "FSDP2's sharded parameters and gradients",
        "optimizer": "the optimizer state and its step",
        "activations": "the activations of the micro-batches in flight",
    }
    if state_where:
        what["optimizer"] = f"the optimizer state ({state_where}) and its step"
    shown = [what[t] for t in ("parameters", "optimizer", "activations") if t in offload]
    return f"on the host ({'pinned' if pin_memory else 'not pinned'}): {'; '.join(shown)}"


def apply(optimizers: Sequence[torch.optim.Optimizer], schedulers: Iterable[Any], plan: Any, group: Any,
          pin_memory: bool) -> list[torch.optim.Optimizer]:  # fmt: skip
    """The optimizers as the plan's offload puts them (right after ``configure_optimizers``): unchanged
    without ``"optimizer"``; FSDP2's host shards (``"parameters"``): their own, stepping with the host
    kernel; FSDP2's device shards: rebuilt host-stepping over them (:func:`host_step_shards`); replicas
    and ZeRO-1 (``group``: the ranks ZeRO-1 shards over, ``mesh.group("optimizer_shard")``): rebuilt
    host-stepping (:func:`host_step`). ``offload_to="disk"``: every mode rebuilt with its state in files
    (:func:`disk_step`; ZeRO-1's shard from its own rank's files).

    Example::

        group = mesh.group("optimizer_shard")
        optimizers = offload.apply(optimizers, [c.scheduler for c in configs], plan, group, False)
    """
    if "optimizer" not in plan.offload:
        return list(optimizers)
    schedulers = list(schedulers)
    shard = plan.data_parallel == "zero1"
    if plan.offload_to == "disk":
        buffer = plan.offload_buffer or DEFAULT_BUFFER
        tier = DiskTier(os.fspath(plan.offload_dir), buffer_bytes=buffer, pin_memory=pin_memory)
        return [disk_step(o, tier, group, shard, schedulers) for o in optimizers]
    if "parameters" in plan.offload:
        for optimizer in optimizers:
            use_host_kernels(optimizer)
        return list(optimizers)
    if plan.data_parallel == "fsdp":
        return [host_step_shards(o, pin_memory, schedulers) for o in optimizers]
    return [host_step(o, group, shard, pin_memory, schedulers) for o in optimizers]
