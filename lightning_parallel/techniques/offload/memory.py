"""What offload does to a stage's bytes: from the device to the host (the planner composes it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Bytes a stage holds on one rank: on its device, and on the host beside it."""

    device: int
    host: int


def memory(
    offload: Sequence[str],
    *,
    parameters: int,
    gradients: int,
    optimizer: int,
    trainable: int,
    activations: int,
    in_flight: int,
    gathered: int = 0,
) -> Placement:
    """Where a stage's bytes live with ``offload`` (the plan's), each given as held on one rank.

    Args:
        parameters, gradients, optimizer: this rank's (FSDP2: its shards; ZeRO-1: ``optimizer`` its shard).
        trainable: the bytes of the trainable parameters this rank's optimizer steps (ZeRO-1: its shard):
            host-stepping keeps a copy of them and a gradient buffer of the same size on the host.
        activations: what one micro-batch keeps until its backward; ``in_flight``: micro-batches at once.
        gathered: FSDP2 only: what stays on the device while a step runs (the unsharded parameters and
            the accumulated unsharded gradients until the one reduce-scatter).

    ``"optimizer"`` moves the state (and adds the host copies); ``"parameters"`` moves the shards, their
    gradients and the state (``gathered`` stays); ``"activations"`` moves all but the micro-batch whose
    backward runs (its saved tensors come back to the device one at a time).

    Example::

        >>> memory(("optimizer",), parameters=40, gradients=40, optimizer=80, trainable=40,
        ...        activations=10, in_flight=2)
        Placement(device=100, host=160)
    """
    device = parameters + gradients + optimizer + gathered + activations * in_flight
    host = 0
    if "parameters" in offload:
        device -= parameters + gradients + optimizer
        host += parameters + gradients + optimizer
    elif "optimizer" in offload:
        device -= optimizer
        host += optimizer + 2 * trainable
    if "activations" in offload and in_flight:
        device -= activations * (in_flight - 1)
        host += activations * in_flight
    return Placement(device, host)
