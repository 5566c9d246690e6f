"""The planner's model of offload: what a rank keeps on its device and what moves to the host.

Modelled from the offload runtime's design (``PipelineStrategy(offload=...)``, ``techniques/offload.py``):

- ``"optimizer"`` (replicas and ZeRO-1): the user's optimizer steps host copies of the parameters.
  The device keeps the parameters and their gradients; the host keeps a copy of the trainable
  parameters, a gradient buffer and the optimizer state (under ZeRO-1, of the rank's shard). Once per
  optimizer step the gradients go to the host and the updated parameters come back.
- ``"parameters"`` (FSDP2's ``CPUOffloadPolicy``, which takes the optimizer with it): the host keeps the
  rank's shard of the parameters, of the gradients and of the optimizer state; the device holds the
  stage gathered during the schedule and its unsharded gradients until the reduce-scatter.
- ``"activations"``: what the micro-batches in flight save for backward waits on the host; the device
  holds a micro-batch's saved tensors only while its forward or backward runs.

On a machine without an accelerator the device is the host: both columns are the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_parallel.memory.stage_costs import StageCosts


@dataclass(frozen=True)
class Moved:
    """Bytes a rank's device no longer holds (``parameters``, ``optimizer``) and what the host holds."""

    parameters: int = 0
    optimizer: int = 0
    host: int = 0


def optimizer_offload(trainable: int, grads: int, state: int, state_whole: int) -> Moved:
    """``"optimizer"``: the state leaves the device; the host holds it with the parameters and gradients
    it steps (a ``state / state_whole`` share of them under ZeRO-1, whose optimizer steps its shard).

    Example::

        >>> optimizer_offload(trainable=400, grads=400, state=800, state_whole=800)
        Moved(parameters=0, optimizer=800, host=1600)
    """
    share = state / state_whole if state_whole else 1.0
    return Moved(0, state, round((trainable + grads) * share) + state)


def parameter_offload(shard: int, grad_shard: int, state: int) -> Moved:
    """``"parameters"`` (FSDP2): the rank's shard of parameters, gradients and state lives on the host.

    Example::

        >>> parameter_offload(shard=200, grad_shard=200, state=400)
        Moved(parameters=200, optimizer=400, host=800)
    """
    return Moved(shard, state, shard + grad_shard + state)


def activations_on_host(stages: list[StageCosts], in_flight: dict[int, int]) -> tuple[list[StageCosts], int]:
    """``"activations"``: the stages as the device sees them (a micro-batch's saved tensors only during its
    backward, as a transient) and the host's bytes (every stage's micro-batches in flight at their most).

    Example::

        device_stages, host = activations_on_host(local_costs, peak_in_flight(actions[rank]))
    """
    host = sum(c.per_microbatch * in_flight.get(c.index, 0) for c in stages)
    device = [replace(c, per_microbatch=0, backward_transient=c.backward_transient + c.per_microbatch)
              for c in stages]  # fmt: skip
    return device, host
