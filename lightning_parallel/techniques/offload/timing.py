"""Offloaded activations timed in place, for the planner: one block's forward and backward under the
saved-tensor hooks against the same block without them.

A copy's bytes at the link's speed leave out what the hooks cost per saved tensor (a host tensor made,
weak references kept, one Python call per tensor): in a small model that is most of it (a two-block
CharLM of width 32: 70 ms measured against 25 ms predicted from the copies alone). So ``plan="auto"``
measures the block (the technique's ``measure`` member) and ``time`` charges each stage what the block
paid per byte its hooks packed, at the stage's bytes per micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

from lightning_parallel.techniques.ledgers import Line, TimeBench
from lightning_parallel.techniques.offload.activations import ActivationOffload


@dataclass(frozen=True)
class ActivationTimes:
    """A block's activations offloaded, measured in place, as lines in the micro-batch's samples:
    ``packed``: the bytes its hooks moved to the host in one forward; ``forward``/``backward``: what the
    hooks added to its forward (the copies out) and backward (the copies back).

    Example::

        times = measure_activations(bench)              # on every rank of the job
        times.forward.at(8) / times.packed.at(8)        # seconds per byte offloaded, 8 samples a micro-batch
    """

    packed: Line
    forward: Line
    backward: Line

    def seconds(self, nbytes: float, samples: float) -> tuple[float, float]:
        """Forward and backward seconds of offloading ``nbytes`` of activations of a micro-batch of
        ``samples``: the block's per byte packed at that size."""
        packed = self.packed.at(samples)
        if packed <= 0:
            return 0.0, 0.0
        share = nbytes / packed
        return share * self.forward.at(samples), share * self.backward.at(samples)


def measure_activations(bench: TimeBench) -> ActivationTimes | None:
    """The bench's block (its first sample) at each recorded size: forward, and forward with backward,
    with and without :class:`ActivationOffload` (pinned on a GPU, as the strategy pins), and the bytes
    the hooks packed; None when the block saves nothing for backward.

    Example::

        measure_activations(bench).forward.at(4)    # seconds the hooks add to the block's forward at 4
    """
    sample = bench.samples[0]
    block = copy.deepcopy(sample.module).to(bench.device)
    pin = bench.device.type == "cuda"
    packed, forward, backward = [], [], []
    for size in sorted(sample.inputs):
        args, kwargs = bench.inputs(sample, size)

        def run(hooks: ActivationOffload | None, back: bool, a: Any = args, k: Any = kwargs) -> None:
            with hooks if hooks is not None else contextlib.nullcontext():
                out = block(*a, **k)
            if back:
                TimeBench.backward(out)

        probe = ActivationOffload(pin_memory=pin)
        run(probe, back=True)
        if probe.packed_bytes == 0:
            return None
        plain_forward = bench.timed(lambda: run(None, back=False))
        plain_both = bench.timed(lambda: run(None, back=True))
        hooked_forward = bench.timed(lambda: run(ActivationOffload(pin_memory=pin), back=False))
        hooked_both = bench.timed(lambda: run(ActivationOffload(pin_memory=pin), back=True))
        packed.append((size, float(probe.packed_bytes)))
        forward.append((size, max(0.0, hooked_forward - plain_forward)))
        backward.append((size, max(0.0, (hooked_both - hooked_forward) - (plain_both - plain_forward))))
    return ActivationTimes(Line.through(packed), Line.through(forward), Line.through(backward))
