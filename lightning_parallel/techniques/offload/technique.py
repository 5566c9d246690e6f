"""Offload as a technique (``offload=``, ``offload_pin_memory``): its settings checked, its refusals, its
label and variants, what the job needs (a host backend, parameters left on the host), and its transforms.

* the optimizers, right after ``configure_optimizers`` (:meth:`Offload.optimizers`). Plain replicas and
  ZeRO-1: each is rebuilt as the user's class made host-stepping (``host_optimizer.py``): it keeps the
  user's param groups (the device parameters, which clipping, loss scaling and LR schedulers read and
  write) and steps a copy of itself over host copies of the trainable parameters; the gradients reach
  the host once per optimizer step, the updated parameters return once. ZeRO-1 builds its shard's
  optimizer from that class. FSDP2 stages (``offload="parameters"``): the user's optimizer holds FSDP2's
  host shards already (FSDP2 reads ``plan.offload`` itself); its step runs the fastest host kernel;
* each training step (:meth:`Offload.step_context`): the saved activations on the host
  (``activations.py``).

For the planner: what it moves from a rank's device to its host (:meth:`Offload.memory`, with
``memory.py``'s arithmetic) and the copies and the host step it adds to a step (:meth:`Offload.time`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from lightning_parallel._options import unknown_option_error
from lightning_parallel.layout.choices import OFFLOAD_TARGETS
from lightning_parallel.techniques.contract import (
    Environment,
    Job,
    MemoryLedger,
    SearchOptions,
    Technique,
    TimeLedger,
)
from lightning_parallel.techniques.offload.activations import ActivationOffload
from lightning_parallel.techniques.offload.host_optimizer import host_step, use_host_kernels
from lightning_parallel.techniques.offload.memory import memory

SHORT = {"optimizer": "opt", "parameters": "param", "activations": "act"}
"""Each target's name in a plan's label."""


class Offload(Technique):
    """``offload=``: the optimizer state and its step, FSDP2's shards, or the saved activations, on the host.

    Example::

        ParallelPlan(devices=2, pipeline_size=2, offload="optimizer").label()
        # 'pp 2x1 1f1b m=4 +offload opt'
    """

    name, fields, searched = "offload", ("offload", "offload_pin_memory"), ("offload",)

    def normalized(self, plan: Any) -> dict[str, Any]:
        if plan.offload_pin_memory is not None and not isinstance(plan.offload_pin_memory, bool):
            raise TypeError(
                f"offload_pin_memory must be True, False or None, got {plan.offload_pin_memory!r}"
            )
        return {"offload": checked_offload(plan.offload, plan.data_parallel)}

    def check(self, plan: Any) -> None:
        if plan.offload and plan.strategy != "pipeline":
            raise ValueError(
                f"offload runs under PipelineStrategy, but strategy={plan.strategy!r}: use "
                f"strategy='pipeline' (pipeline_size=1 for one device or pure data parallelism)"
            )
        check_offload(plan.offload, plan.tensor_parallel_size, plan.parallelize_fn)

    def label(self, plan: Any) -> str:
        if not plan.offload:
            return ""
        shown = [SHORT[t] for t in plan.offload if t != "optimizer" or "parameters" not in plan.offload]
        return f" +offload {','.join(shown)}"

    def variants(self, plan: Any, search: SearchOptions) -> Iterator[dict[str, Any]]:
        yield {}
        if not search.offload or plan.offload:
            return
        yield {"offload": ("optimizer",)}  # (replicas and ZeRO-1)
        if search.offload_parameters:
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

    def optimizers(self, optimizers: list[torch.optim.Optimizer], job: Job) -> list[torch.optim.Optimizer]:
        if not job.plan.offload:
            return optimizers
        job.info(f"PipelineStrategy: {describe(job.plan.offload, job.pin_memory)}")
        return apply(optimizers, job.schedulers, job.plan, job.mesh.group("optimizer_shard"), job.pin_memory)

    def step_context(self, job: Job) -> ActivationOffload | None:
        return ActivationOffload(job.pin_memory) if "activations" in job.plan.offload else None

    def memory(self, ledger: MemoryLedger) -> None:
        """The parameter and optimizer bytes moved off the rank's device, and the host's bytes (``memory.py``,
        as the techniques before it left them: FSDP2's shards, ZeRO-1's share of the state); with
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

    def time(self, ledger: TimeLedger) -> None:
        """Offloaded activations: their copy to the host in forward and back in backward. FSDP2's shards:
        their copy up before the all-gather, the gradients' down after the reduce-scatter. The optimizer
        state: the gradients to the host and the parameters back. Either way the optimizer steps on the
        host (its extra over the device's step charged to offload)."""
        offload, links = ledger.plan.offload, ledger.links
        if "activations" in offload:
            for c in ledger.stages:
                copies = links.copy(c.per_microbatch)
                ledger.forward[c.index] += copies
                ledger.backward[c.index] += copies
                ledger.share(c.index, "offload", 2 * copies)
        trainable = [ledger.facts.tensors[k] for k in ledger.keys if ledger.facts.tensors[k].grad]
        grads = ledger.gradients
        if "parameters" in offload:
            shards = ledger.plan.shard_size
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


TECHNIQUE = Offload()


def _state_to_host(ledger: MemoryLedger, hosted: tuple[str, ...]) -> None:
    """The parameters (FSDP2's shards) and the optimizer state off the device, the host's bytes on it."""
    device, tensors = ledger.device, [ledger.facts.tensors[k] for k in ledger.keys]
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


def checked_offload(offload: Any, data_parallel: str) -> tuple[str, ...]:
    """What lives on the host, as a sorted tuple of :data:`OFFLOAD_TARGETS` (a name or a list of names).

    ``"parameters"`` is FSDP2's offload, which takes the optimizer state with it (all or nothing): it
    implies ``"optimizer"`` and needs ``data_parallel="fsdp"``; an FSDP2 stage cannot offload its
    optimizer state alone.

    Example::

        >>> checked_offload("optimizer", "replicate")
        ('optimizer',)
        >>> checked_offload(["parameters"], "fsdp")
        ('optimizer', 'parameters')
    """
    if offload is None or offload is False:
        return ()
    names = (offload,) if isinstance(offload, str) else offload
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"offload must be one of {', '.join(map(repr, OFFLOAD_TARGETS))} or a list of them, got "
            f"{offload!r}"
        )
    for name in names:
        if name not in OFFLOAD_TARGETS:
            raise unknown_option_error("PipelineStrategy(offload=...)", name, OFFLOAD_TARGETS)
    chosen = set(names) | ({"optimizer"} if "parameters" in names else set())
    if "parameters" in chosen and data_parallel != "fsdp":
        raise ValueError(
            f"offload='parameters' is FSDP2's offload of each stage's sharded parameters and gradients, but "
            f"data_parallel={data_parallel!r}: use data_parallel='fsdp', or offload='optimizer' (the "
            f"optimizer state and its step on the host)"
        )
    if data_parallel == "fsdp" and "optimizer" in chosen and "parameters" not in chosen:
        raise ValueError(
            "data_parallel='fsdp' offloads the optimizer state only together with the sharded parameters "
            "and gradients (FSDP2's CPUOffloadPolicy is all or nothing, pytorch#187615): pass "
            "offload='parameters', or use data_parallel='replicate' or 'zero1' with offload='optimizer'"
        )
    return tuple(sorted(chosen))


def check_offload(offload: tuple[str, ...], tensor_parallel_size: int, parallelize_fn: Any) -> None:
    """Refuse offload where it is not supported yet, with the reason and the fix.

    Raises:
        ValueError: offload with tensor-parallel stages; FSDP2's offload with a ``parallelize_fn``.

    Example::

        >>> check_offload(("optimizer",), 1, None)          # fine
    """
    if offload and tensor_parallel_size > 1:
        raise ValueError(
            f"offload={list(offload)} with tensor_parallel_size={tensor_parallel_size} is not supported yet: "
            f"the host copies and their checkpoints are written for whole tensors, not tensor-parallel "
            f"DTensor slices, and FSDP2's offload of 2-D shards is untested here. Use tensor_parallel_size=1 "
            f"(data_parallel='fsdp' with offload='parameters' shards each stage over all its ranks instead), "
            f"or drop offload"
        )
    if "parameters" in offload and parallelize_fn is not None:
        raise ValueError(
            "offload='parameters' with a parallelize_fn is not supported: a stage your function shards "
            "with fully_shard would keep its shards on the device (PipelineStrategy gives FSDP2's "
            "CPUOffloadPolicy to the stages it shards itself). Drop parallelize_fn and let "
            "data_parallel='fsdp' shard the stages, or pass offload_policy=CPUOffloadPolicy() to your "
            "own fully_shard and drop offload='parameters'"
        )


def describe(offload: Sequence[str], pin_memory: bool) -> str:
    """What is on the host, in words (the log's line).

    Example::

        >>> describe(("optimizer",), False)
        'on the host (not pinned): the optimizer state and its step'
    """
    what = {
        "parameters": "FSDP2's sharded parameters and gradients",
        "optimizer": "the optimizer state and its step",
        "activations": "the activations of the micro-batches in flight",
    }
    shown = [what[t] for t in ("parameters", "optimizer", "activations") if t in offload]
    return f"on the host ({'pinned' if pin_memory else 'not pinned'}): {'; '.join(shown)}"


def apply(optimizers: Sequence[torch.optim.Optimizer], schedulers: Iterable[Any], plan: Any, group: Any,
          pin_memory: bool) -> list[torch.optim.Optimizer]:  # fmt: skip
    """The optimizers as the plan's offload puts them (right after ``configure_optimizers``): unchanged
    without ``"optimizer"``; FSDP2 stages: their own, stepping with the host kernel; replicas and ZeRO-1
    (``group``: the ranks ZeRO-1 shards over, ``mesh.group("optimizer_shard")``): rebuilt host-stepping
    (:func:`host_step`).

    Example::

        group = mesh.group("optimizer_shard")
        optimizers = offload.apply(optimizers, [c.scheduler for c in configs], plan, group, False)
    """
    if "optimizer" not in plan.offload:
        return list(optimizers)
    if plan.data_parallel == "fsdp":
        for optimizer in optimizers:
            use_host_kernels(optimizer)
        return list(optimizers)
    schedulers = list(schedulers)
    shard = plan.data_parallel == "zero1"
    return [host_step(o, group, shard, pin_memory, schedulers) for o in optimizers]
